# check_cli_includes.cmake: fails when a file of src/cli/ includes a header
# from outside include/ and src/cli/ (issue 9: the CLI is a client of the
# public API, like any embedder).
# Usage: cmake -DSOURCE_DIR=<repo> -P cmake/check_cli_includes.cmake
#
# Each #include "X" or <X> of src/cli/*.c and *.h must name include/X or
# src/cli/X; an angle include that names neither is a system header and
# is fine, unless it names a file under src/ (an internal header reached
# through an include path). A quoted include that names nothing is refused.
#
# There is no exception: `kvpager bench` times the public kvp_paged_attention,
# reads on its own threads with kernels it chooses from the CPU, and times
# page acquire + release through a cache's row reserve and discard. The
# build enforces the same (the CLI's objects see only the public library's
# include directories); this check also names the offending line.
cmake_minimum_required(VERSION 3.25)
file(GLOB files ${SOURCE_DIR}/src/cli/*.c ${SOURCE_DIR}/src/cli/*.h)
set(bad "")
foreach(file ${files})
  get_filename_component(name ${file} NAME)
  file(STRINGS ${file} lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
  foreach(line ${lines})
    string(REGEX MATCH "[<\"]([^>\"]+)[>\"]" _ "${line}")
    set(header ${CMAKE_MATCH_1})
    string(SUBSTRING "${line}" 0 200 shown)
    if(EXISTS ${SOURCE_DIR}/include/${header} OR EXISTS ${SOURCE_DIR}/src/cli/${header})
      continue()
    endif()
    if(EXISTS ${SOURCE_DIR}/src/${header} OR line MATCHES "\"")
      list(APPEND bad "src/cli/${name}: ${shown}")
    endif()
  endforeach()
endforeach()
if(bad)
  list(JOIN bad "\n  " text)
  message(FATAL_ERROR "src/cli/ must include only include/ and src/cli/ headers:\n  ${text}")
endif()
list(LENGTH files count)
message(STATUS "src/cli/: ${count} files include only public and CLI headers")
