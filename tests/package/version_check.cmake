# kvp_version_check(TARGET VERSION LIBRARY): builds version_check.c as TARGET
# against LIBRARY, expecting VERSION ("MAJOR.MINOR.PATCH").
function(kvp_version_check target version library)
  string(REPLACE "." ";" parts "${version}")
  list(GET parts 0 major)
  list(GET parts 1 minor)
  list(GET parts 2 patch)
  add_executable(${target} ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/version_check.c)
  set_target_properties(${target} PROPERTIES C_STANDARD 11 C_STANDARD_REQUIRED ON)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
  target_compile_definitions(${target} PRIVATE EXPECT_MAJOR=${major} EXPECT_MINOR=${minor}
                             EXPECT_PATCH=${patch} EXPECT_STRING="${version}")
  target_link_libraries(${target} PRIVATE ${library})
endfunction()
