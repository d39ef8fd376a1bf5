/*
 * version_check.c: the package test's version probe. Built against an
 * installed or embedded kvpager with EXPECT_MAJOR, EXPECT_MINOR, EXPECT_PATCH
 * and EXPECT_STRING taken from the package's own version (the CMake package
 * version, or pkg-config's); checks that kvpager/version.h agrees with it at
 * compile time, and that the library it runs with agrees at run time.
 */
#include <kvpager/kvpager.h>
#include <kvpager/version.h>

#include <stdio.h>
#include <string.h>

#if KVP_VERSION_MAJOR != EXPECT_MAJOR || KVP_VERSION_MINOR != EXPECT_MINOR || \
    KVP_VERSION_PATCH != EXPECT_PATCH
#error "kvpager/version.h disagrees with the package version"
#endif
#if KVP_VERSION_NUMBER != EXPECT_MAJOR * 1000000 + EXPECT_MINOR * 1000 + EXPECT_PATCH
#error "KVP_VERSION_NUMBER is not MAJOR * 1000000 + MINOR * 1000 + PATCH"
#endif

int main(void)
{
    if (strcmp(KVP_VERSION_STRING, EXPECT_STRING) != 0 ||
        strcmp(kvp_version(), KVP_VERSION_STRING) != 0 ||
        kvp_version_number() != KVP_VERSION_NUMBER) {
        fprintf(stderr, "version mismatch: headers %s (%ld), library %s (%ld), package %s\n",
                KVP_VERSION_STRING, (long)KVP_VERSION_NUMBER, kvp_version(),
                kvp_version_number(), EXPECT_STRING);
        return 1;
    }
    printf("kvpager %s: headers, library and package agree\n", kvp_version());
    return 0;
}
