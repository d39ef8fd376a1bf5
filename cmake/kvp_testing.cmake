# kvp_testing.cmake: how kvpager registers programs with CTest.
#
# Every test program is registered twice: natively (label `unit`, or the
# label given) and, when KVP_MEMCHECK is on, under Valgrind memcheck (label
# `memcheck`), where any error or any definitely/indirectly lost block fails
# the run with exit code KVP_MEMCHECK_EXIT.
#
# jemalloc 5 has no Valgrind support of its own; --soname-synonyms makes
# memcheck replace malloc/free inside libjemalloc, and the pool's mempool
# client requests describe the pages of its slab.

set(KVP_MEMCHECK_EXIT 97)
if(KVP_MEMCHECK)
  find_program(VALGRIND_EXECUTABLE valgrind REQUIRED)
endif()
set(KVP_MEMCHECK_COMMAND
    ${VALGRIND_EXECUTABLE} --tool=memcheck --quiet
    --leak-check=full --show-leak-kinds=definite,indirect
    --errors-for-leak-kinds=definite,indirect
    --error-exitcode=${KVP_MEMCHECK_EXIT}
    --soname-synonyms=somalloc=*jemalloc*
    --num-callers=32)

# kvp_add_program_test(NAME name TARGET target [LABEL label] [ARGS ...]
#                      [MEMCHECK_ARGS ...] [TIMEOUT seconds])
function(kvp_add_program_test)
  cmake_parse_arguments(T "" "NAME;TARGET;LABEL;TIMEOUT" "ARGS;MEMCHECK_ARGS" ${ARGN})
  if(NOT T_LABEL)
    set(T_LABEL unit)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  if(NOT DEFINED T_MEMCHECK_ARGS)
    set(T_MEMCHECK_ARGS ${T_ARGS})
  endif()
  add_test(NAME ${T_NAME} COMMAND ${T_TARGET} ${T_ARGS})
  set_tests_properties(${T_NAME} PROPERTIES LABELS ${T_LABEL} TIMEOUT ${T_TIMEOUT})
  if(KVP_MEMCHECK)
    add_test(NAME memcheck.${T_NAME}
             COMMAND ${KVP_MEMCHECK_COMMAND} $<TARGET_FILE:${T_TARGET}> ${T_MEMCHECK_ARGS})
    set_tests_properties(memcheck.${T_NAME} PROPERTIES LABELS memcheck TIMEOUT 900)
  endif()
endfunction()
