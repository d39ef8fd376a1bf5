/*
 * dispatch.c: the one function table of the dot/axpy kernels (kernels.h).
 *
 * Owns: the choice of the active level. It is made once per process, under
 * pthread_once, from what this binary was built with (the x86-64 levels only
 * on x86-64) and what the CPU runs (__builtin_cpu_supports, which also checks
 * that the OS saves the wider registers; the x86 levels also need FMA and
 * F16C, for the fast accumulation level and f16 rows), unless KVP_ISA names a level: a
 * level the CPU lacks, or an unknown name, is refused with one line on
 * stderr, and the best supported level is used instead.
 *
 * Invariant: `active` is never NULL once kvpi_kernels_active() has returned,
 * and always points to a level the CPU runs. A constructor makes the choice
 * before main, while the process has one thread; pthread_once still guards
 * it for programs that call in earlier. The pointer is atomic, so a test
 * forcing a level (kvpi_kernels_use) is no data race either.
 * Callers: kernels.h's inline wrappers, gather.c, tests and benchmarks.
 */
#include <pthread.h>
#if defined(KVPI_X86_KERNELS)
#include <cpuid.h>
#endif
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/kernels.h"

static const char *const isa_names[KVPI_ISA_COUNT] = {"scalar", "avx2", "avx512"};

static pthread_once_t choose_once = PTHREAD_ONCE_INIT;
static _Atomic(const kvpi_kernels *) active;

#if defined(KVPI_X86_KERNELS)
/* CPUID.1:ECX bit 29 (clang's __builtin_cpu_supports has no "f16c"). */
static int has_f16c(void)
{
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}
#endif

/* Built into this binary, and run by this CPU. */
static int cpu_runs(kvpi_isa isa)
{
    switch (isa) {
    case KVPI_ISA_SCALAR:
        return 1;
#if defined(KVPI_X86_KERNELS)
    case KVPI_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case KVPI_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma") && has_f16c();
#endif
    default:
        return 0;
    }
}

const kvpi_kernels *kvpi_kernels_level(kvpi_isa isa)
{
    if (!cpu_runs(isa)) {
        return NULL;
    }
    switch (isa) {
#if defined(KVPI_X86_KERNELS)
    case KVPI_ISA_AVX2:
        return &kvpi_kernels_avx2;
    case KVPI_ISA_AVX512:
        return &kvpi_kernels_avx512;
#endif
    default:
        return &kvpi_kernels_scalar;
    }
}

kvpi_isa kvpi_kernels_best(void)
{
    for (int isa = KVPI_ISA_COUNT - 1; isa > KVPI_ISA_SCALAR; isa--) {
        if (kvpi_kernels_level((kvpi_isa)isa) != NULL) {
            return (kvpi_isa)isa;
        }
    }
    return KVPI_ISA_SCALAR;
}

const char *kvpi_isa_name(kvpi_isa isa)
{
    return (unsigned)isa < KVPI_ISA_COUNT ? isa_names[isa] : "unknown";
}

int kvpi_isa_parse(const char *name, kvpi_isa *isa)
{
    for (int i = 0; i < KVPI_ISA_COUNT; i++) {
        if (name != NULL && strcmp(name, isa_names[i]) == 0) {
            *isa = (kvpi_isa)i;
            return 0;
        }
    }
    return -1;
}

static void choose(void)
{
    kvpi_isa best = kvpi_kernels_best();
    kvpi_isa isa = best;
    const char *wanted = getenv("KVP_ISA");
    if (wanted != NULL && wanted[0] != '\0') {
        kvpi_isa forced;
        if (kvpi_isa_parse(wanted, &forced) != 0) {
            fprintf(stderr, "kvpager: KVP_ISA='%s' is not scalar, avx2 or avx512; using %s\n",
                    wanted, isa_names[best]);
        } else if (kvpi_kernels_level(forced) == NULL) {
            fprintf(stderr, "kvpager: KVP_ISA=%s is not supported by this CPU or build; "
                    "using %s\n", wanted, isa_names[best]);
        } else {
            isa = forced;
        }
    }
    atomic_store_explicit(&active, kvpi_kernels_level(isa), memory_order_release);
}

__attribute__((constructor)) static void choose_at_load(void)
{
    (void)kvpi_kernels_active();
}

const kvpi_kernels *kvpi_kernels_active(void)
{
    const kvpi_kernels *k = atomic_load_explicit(&active, memory_order_acquire);
    if (k == NULL) {
        pthread_once(&choose_once, choose);
        k = atomic_load_explicit(&active, memory_order_acquire);
    }
    return k;
}

int kvpi_kernels_use(kvpi_isa isa)
{
    const kvpi_kernels *k = kvpi_kernels_level(isa);
    if (k == NULL) {
        return -1;
    }
    pthread_once(&choose_once, choose); /* so a later first call cannot undo this */
    atomic_store_explicit(&active, k, memory_order_release);
    return 0;
}
