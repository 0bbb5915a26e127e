# tessera._fastcall: the optional CPython extension of the Python package's run() fast path
# (python/_fastcall.c, _fastcall_describe.c, _fastcall_runner.c and their private header
# _fastcall.h). Limited API (abi3, Python >= 3.9): one binary for every CPython 3.9+, loaded by
# the package from the folder of libtessera.so (python/tessera/_fast.py). It does not link
# libtessera (the run functions' addresses come from the ctypes binding) nor
# libpython. Skipped, with a message, when the Python headers are not found; the package then
# uses its ctypes path.
option(TESSERA_BUILD_PYTHON_EXT "Build the tessera._fastcall Python extension" ON)
if(NOT TESSERA_BUILD_PYTHON_EXT)
  return()
endif()
if(TESSERA_SANITIZE)
  message(STATUS "Tessera: Python extension _fastcall skipped (TESSERA_SANITIZE)")
  return()
endif()
find_package(Python3 3.9 QUIET COMPONENTS Interpreter Development.Module)
if(NOT Python3_Development.Module_FOUND)
  message(STATUS "Tessera: Python extension _fastcall skipped (Python 3 headers not found; "
                 "the package uses its ctypes path)")
  # The wheel build names this target (pyproject.toml build.targets): keep it buildable.
  add_custom_target(tessera_fastcall COMMAND ${CMAKE_COMMAND} -E echo
                    "tessera_fastcall: skipped, Python 3 headers not found" VERBATIM)
  return()
endif()
enable_language(C)
add_library(tessera_fastcall MODULE ${PROJECT_SOURCE_DIR}/python/_fastcall.c
                                    ${PROJECT_SOURCE_DIR}/python/_fastcall_describe.c
                                    ${PROJECT_SOURCE_DIR}/python/_fastcall_runner.c)
# _fastcall.abi3.so beside libtessera.so, in the build folder as in the wheel.
set_target_properties(tessera_fastcall PROPERTIES
  OUTPUT_NAME _fastcall PREFIX "" SUFFIX ".abi3.so"
  LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
  C_STANDARD 11 C_STANDARD_REQUIRED ON C_VISIBILITY_PRESET hidden)
target_include_directories(tessera_fastcall PRIVATE ${PROJECT_SOURCE_DIR}/include
                                                    ${Python3_INCLUDE_DIRS})
target_compile_options(tessera_fastcall PRIVATE -Wall -Wextra -Wno-unused-parameter
                       -Wno-missing-field-initializers $<$<BOOL:${TESSERA_WERROR}>:-Werror>)
message(STATUS "Tessera: Python extension _fastcall (abi3, headers ${Python3_INCLUDE_DIRS})")
if(SKBUILD)
  install(TARGETS tessera_fastcall LIBRARY DESTINATION . COMPONENT tessera_python)
endif()
