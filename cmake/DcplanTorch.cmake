# Finds libtorch through the Python package (torch.utils.cmake_prefix_path).
# Leaves DCPLAN_WITH_TORCH effective only when torch is importable.
# DCPLAN_REQUIRE_TORCH (the wheel preset): no torch is an error, not a build without the runtime.
option(DCPLAN_REQUIRE_TORCH "Fail the configure when torch is not importable" OFF)
# Under pip (scikit-build-core sets SKBUILD, and Python3_EXECUTABLE to the target environment's
# interpreter), PYTHONPATH points into pip's isolated build environment, which hides the installed
# torch: -I ignores it, so that the extension is built against the torch it will run with.
# A torch that only PYTHONPATH or the user site shows: -Ccmake.define.DCPLAN_PYTHON_ISOLATED=""
# with --no-build-isolation.
if(SKBUILD)
  set(DCPLAN_PYTHON_ISOLATED -I CACHE STRING "flags of the interpreter run that finds torch under pip")
else()
  set(DCPLAN_PYTHON_ISOLATED "" CACHE STRING "flags of the interpreter run that finds torch")
endif()
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
if(Python3_Interpreter_FOUND)
  # One interpreter start (importing torch takes seconds): torch's CMake prefix, the libstdc++
  # the process runs on with torch loaded (checked against the compiler's below), torch's version.
  execute_process(
    COMMAND ${Python3_EXECUTABLE} ${DCPLAN_PYTHON_ISOLATED} -c
      "import torch.utils; print(torch.utils.cmake_prefix_path); print(next((l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++.so' in l), '-')); print(torch.__version__)"
    OUTPUT_VARIABLE DCPLAN_TORCH_QUERY OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE DCPLAN_TORCH_RESULT ERROR_VARIABLE DCPLAN_TORCH_ERROR)
  string(REPLACE "\n" ";" DCPLAN_TORCH_QUERY "${DCPLAN_TORCH_QUERY}")
  list(LENGTH DCPLAN_TORCH_QUERY DCPLAN_TORCH_QUERY_LINES)
  if(DCPLAN_TORCH_RESULT EQUAL 0 AND DCPLAN_TORCH_QUERY_LINES EQUAL 3)
    list(GET DCPLAN_TORCH_QUERY 0 DCPLAN_TORCH_PREFIX)
    list(GET DCPLAN_TORCH_QUERY 1 DCPLAN_PYTHON_LIBSTDCXX)
    list(GET DCPLAN_TORCH_QUERY 2 DCPLAN_TORCH_PY_VERSION)
    if(DCPLAN_PYTHON_LIBSTDCXX STREQUAL "-")
      set(DCPLAN_PYTHON_LIBSTDCXX "")
    endif()
  else()
    set(DCPLAN_TORCH_RESULT 1)
  endif()
endif()
if(NOT Python3_Interpreter_FOUND OR NOT DCPLAN_TORCH_RESULT EQUAL 0)
  if(DCPLAN_REQUIRE_TORCH)
    message(FATAL_ERROR "dcplan: torch is not importable by ${Python3_EXECUTABLE} (${DCPLAN_TORCH_ERROR}); "
      "install torch 2.11 to 2.14 into this environment first, e.g. pip install torch==2.13.0")
  endif()
  message(STATUS "dcplan: torch not importable by Python; building without the runtime")
  return()
endif()
# A build directory configured against another torch (pip's build directory serves every
# environment of one Python) keeps that torch's paths in its cache (Torch_DIR, TORCH_LIBRARY, ...):
# drop every cached path under the old torch, so that this one is found afresh.
if(DEFINED CACHE{DCPLAN_TORCH_PREFIX_USED} AND NOT DCPLAN_TORCH_PREFIX_USED STREQUAL DCPLAN_TORCH_PREFIX)
  get_filename_component(DCPLAN_OLD_TORCH_ROOT "${DCPLAN_TORCH_PREFIX_USED}/../.." ABSOLUTE)
  get_cmake_property(DCPLAN_CACHED CACHE_VARIABLES)
  foreach(var IN LISTS DCPLAN_CACHED)
    get_property(value CACHE ${var} PROPERTY VALUE)
    string(FIND "${value}" "${DCPLAN_OLD_TORCH_ROOT}" at)
    if(NOT at EQUAL -1)
      unset(${var} CACHE)
    endif()
  endforeach()
  message(STATUS "dcplan: torch moved from ${DCPLAN_OLD_TORCH_ROOT}; its cached paths are dropped")
endif()
set(DCPLAN_TORCH_PREFIX_USED "${DCPLAN_TORCH_PREFIX}" CACHE INTERNAL "torch's CMake prefix this cache was made with")
list(APPEND CMAKE_PREFIX_PATH "${DCPLAN_TORCH_PREFIX}")
if(DCPLAN_WITH_CUDA)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()
find_package(Torch QUIET)
if(NOT TARGET torch)
  if(DCPLAN_REQUIRE_TORCH)
    message(FATAL_ERROR "dcplan: find_package(Torch) failed under ${DCPLAN_TORCH_PREFIX}")
  endif()
  message(STATUS "dcplan: find_package(Torch) failed; building without the runtime")
  return()
endif()
# Every target of this build, torch-free ones included (schemas, planner), must use torch's
# libstdc++ ABI: the runtime passes std::string and containers to them, which two ABIs lay out
# differently.
string(REGEX MATCH "_GLIBCXX_USE_CXX11_ABI=([01])" DCPLAN_TORCH_ABI_FLAG "${TORCH_CXX_FLAGS}")
if(DCPLAN_TORCH_ABI_FLAG)
  add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${CMAKE_MATCH_1})
  message(STATUS "dcplan: libstdc++ ABI of torch: _GLIBCXX_USE_CXX11_ABI=${CMAKE_MATCH_1}")
endif()
# The runtime is loaded into Python next to torch and uses the libstdc++ that Python loaded.
# A compiler with a newer libstdc++ (the GPU machine's CXX, /opt/gcc/bin/g++) builds code that
# crashes in it (std::locale: number formatting in error messages, std::regex).
execute_process(
  COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
  OUTPUT_VARIABLE DCPLAN_COMPILER_LIBSTDCXX OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(DCPLAN_COMPILER_LIBSTDCXX AND DCPLAN_PYTHON_LIBSTDCXX AND EXISTS "${DCPLAN_COMPILER_LIBSTDCXX}")
  file(REAL_PATH "${DCPLAN_COMPILER_LIBSTDCXX}" DCPLAN_COMPILER_LIBSTDCXX)
  file(REAL_PATH "${DCPLAN_PYTHON_LIBSTDCXX}" DCPLAN_PYTHON_LIBSTDCXX)
  if(NOT DCPLAN_COMPILER_LIBSTDCXX STREQUAL DCPLAN_PYTHON_LIBSTDCXX)
    message(WARNING "dcplan: ${CMAKE_CXX_COMPILER} links ${DCPLAN_COMPILER_LIBSTDCXX}, but Python with torch "
      "runs on ${DCPLAN_PYTHON_LIBSTDCXX}; if the compiler's is newer, the runtime can crash in std::locale "
      "(error messages). Configure with -DCMAKE_CXX_COMPILER=<the system g++> (docs/gpu.md).")
  endif()
endif()
if(DCPLAN_WITH_CUDA)
  # NCCL: the headers and library of torch's nvidia-nccl wheel first (the library torch itself
  # loads), then NCCL_HOME / NCCL_ROOT and the system.
  execute_process(
    COMMAND ${Python3_EXECUTABLE} ${DCPLAN_PYTHON_ISOLATED} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
    OUTPUT_VARIABLE DCPLAN_NCCL_WHEEL_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  find_path(DCPLAN_NCCL_INCLUDE_DIR nccl.h
    HINTS ${DCPLAN_NCCL_WHEEL_DIR}/include $ENV{NCCL_HOME}/include $ENV{NCCL_ROOT}/include)
  find_library(DCPLAN_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
    HINTS ${DCPLAN_NCCL_WHEEL_DIR}/lib $ENV{NCCL_HOME}/lib $ENV{NCCL_ROOT}/lib)
  if(NOT DCPLAN_NCCL_INCLUDE_DIR OR NOT DCPLAN_NCCL_LIBRARY)
    message(FATAL_ERROR "dcplan: DCPLAN_WITH_CUDA=ON needs NCCL (nccl.h and libnccl); set NCCL_HOME")
  endif()
  add_library(dcplan_nccl INTERFACE)
  target_include_directories(dcplan_nccl INTERFACE ${DCPLAN_NCCL_INCLUDE_DIR})
  target_link_libraries(dcplan_nccl INTERFACE ${DCPLAN_NCCL_LIBRARY})
  message(STATUS "dcplan: NCCL from ${DCPLAN_NCCL_INCLUDE_DIR}, ${DCPLAN_NCCL_LIBRARY}")
endif()
# torch_python is linked only into the pybind11 module.
find_library(DCPLAN_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
# The Python module uses the pybind11 headers bundled with torch (on the torch
# target's include path), so that its type registry matches torch_python's.
# The C++ torch found must be the Python torch the extension will run with (_build_info.py
# records the latter, and dcplan/__init__.py checks it at import).
string(REGEX MATCH "^[0-9]+\\.[0-9]+" DCPLAN_TORCH_CXX_RELEASE "${Torch_VERSION}")
string(REGEX MATCH "^[0-9]+\\.[0-9]+" DCPLAN_TORCH_PY_RELEASE "${DCPLAN_TORCH_PY_VERSION}")
if(NOT DCPLAN_TORCH_CXX_RELEASE STREQUAL DCPLAN_TORCH_PY_RELEASE)
  message(FATAL_ERROR "dcplan: find_package(Torch) found torch ${Torch_VERSION} (${Torch_DIR}), but "
    "${Python3_EXECUTABLE} imports torch ${DCPLAN_TORCH_PY_VERSION}; remove the build directory and configure again")
endif()
message(STATUS "dcplan: building the runtime against torch ${Torch_VERSION} (Python: ${DCPLAN_TORCH_PY_VERSION})")
