# Helper functions shared by every part of the build: warnings, libraries, tests.

add_library(dcplan_warnings INTERFACE)
target_compile_options(dcplan_warnings INTERFACE -Wall -Wextra -Wpedantic -Wno-unused-parameter)

add_library(dcplan_sanitizers INTERFACE)
if(DCPLAN_SANITIZE)
  target_compile_options(dcplan_sanitizers INTERFACE -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(dcplan_sanitizers INTERFACE -fsanitize=address,undefined)
endif()

find_program(DCPLAN_CCACHE ccache)
if(DCPLAN_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_CXX_COMPILER_LAUNCHER "${DCPLAN_CCACHE}" CACHE STRING "" FORCE)
endif()

# dcplan_add_library(NAME SOURCES ... [PUBLIC_DEPS ...] [PRIVATE_DEPS ...])
# A static library with its public headers under <dir>/include.
function(dcplan_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include
                                     PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS}
                                PRIVATE ${ARG_PRIVATE_DEPS} dcplan_warnings dcplan_sanitizers)
  target_link_options(${name} PUBLIC $<$<BOOL:${DCPLAN_SANITIZE}>:-fsanitize=address,undefined>)
endfunction()

# dcplan_add_executable(NAME SOURCES ... [DEPS ...])
function(dcplan_add_executable name)
  cmake_parse_arguments(ARG "" "OUTPUT_NAME" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} dcplan_warnings dcplan_sanitizers)
  if(ARG_OUTPUT_NAME)
    set_target_properties(${name} PROPERTIES OUTPUT_NAME ${ARG_OUTPUT_NAME})
  endif()
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
endfunction()

# dcplan_add_gtest(NAME SOURCES ... [DEPS ...]): one GoogleTest executable per library.
function(dcplan_add_gtest name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gtest_main
                                        dcplan_warnings dcplan_sanitizers)
  target_compile_definitions(${name} PRIVATE
    DCPLAN_SOURCE_DIR="${PROJECT_SOURCE_DIR}" DCPLAN_BINARY_DIR="${CMAKE_BINARY_DIR}")
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS unit)
endfunction()
