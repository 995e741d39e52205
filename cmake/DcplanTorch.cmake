# Finds libtorch through the Python package (torch.utils.cmake_prefix_path).
# Leaves DCPLAN_WITH_TORCH effective only when torch is importable.
find_package(Python3 COMPONENTS Interpreter Development.Module QUIET)
if(Python3_Interpreter_FOUND)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE DCPLAN_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE DCPLAN_TORCH_RESULT ERROR_QUIET)
endif()
if(NOT Python3_Interpreter_FOUND OR NOT DCPLAN_TORCH_RESULT EQUAL 0)
  message(STATUS "dcplan: torch not importable by Python; building without the runtime")
  return()
endif()
list(APPEND CMAKE_PREFIX_PATH "${DCPLAN_TORCH_PREFIX}")
if(DCPLAN_WITH_CUDA)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
endif()
find_package(Torch QUIET)
if(NOT TARGET torch)
  message(STATUS "dcplan: find_package(Torch) failed; building without the runtime")
  return()
endif()
# torch_python is linked only into the pybind11 module.
find_library(DCPLAN_TORCH_PYTHON_LIBRARY torch_python PATHS "${TORCH_INSTALL_PREFIX}/lib" REQUIRED)
# The Python module uses the pybind11 headers bundled with torch (on the torch
# target's include path), so that its type registry matches torch_python's.
message(STATUS "dcplan: building the runtime against torch ${Torch_VERSION}")
