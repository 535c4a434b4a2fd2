# Cross-compiles for macOS on Apple silicon (aarch64-macos, deployment target
# 14.0 like MLX's wheels) with zig's clang and Mach-O linker, which ship the
# macOS libc headers and link stubs. zig comes from PyPI's `ziglang` package of
# the Python named by ZIG_PYTHON (default: python3 on PATH).
#   cmake -S . -B build/macos --toolchain cmake/zig-aarch64-macos.cmake ...
set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_PROCESSOR arm64)
set(CMAKE_SYSTEM_VERSION 23.0)  # Darwin 23 = macOS 14
set(CMAKE_OSX_ARCHITECTURES "" CACHE STRING "")
set(CMAKE_OSX_DEPLOYMENT_TARGET "" CACHE STRING "")
set(CMAKE_OSX_SYSROOT "" CACHE PATH "")

# try_compile projects re-read this file: pass the choice along.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES ZIG_PYTHON)
if(NOT ZIG_PYTHON)
  find_program(ZIG_PYTHON NAMES python3 python REQUIRED)
endif()
execute_process(
  COMMAND "${ZIG_PYTHON}" -c "import ziglang, os; print(os.path.dirname(ziglang.__file__))"
  OUTPUT_VARIABLE zig_dir OUTPUT_STRIP_TRAILING_WHITESPACE COMMAND_ERROR_IS_FATAL ANY)

# CMake wants one executable per tool: small wrappers around `zig <tool>`.
# Two link flags of a Python module are rewritten for zig's Mach-O linker:
# - nanobind lists CPython's symbols for ld64's -U in a response file, which
#   zig does not read: -undefined dynamic_lookup instead, as macOS extensions
#   have long linked (the interpreter provides those symbols at load time);
# - zig cannot write MH_BUNDLE files: -bundle becomes -shared, a Mach-O dylib,
#   which Python's import (dlopen) loads the same way.
set(zig_target aarch64-macos.14.0)
set(wrappers "${CMAKE_BINARY_DIR}/zig-tools")
set(rewrite [=[
for a do
  shift
  case $a in
    -Wl,@*darwin-ld-*.sym) set -- "$@" -Wl,-undefined,dynamic_lookup ;;
    -bundle) set -- "$@" -shared ;;
    *) set -- "$@" "$a" ;;
  esac
done
]=])
foreach(tool cc c++ ar ranlib)
  if(tool STREQUAL "cc" OR tool STREQUAL "c++")
    file(WRITE "${wrappers}/zig-${tool}.in"
         "#!/bin/sh\n${rewrite}exec \"${zig_dir}/zig\" ${tool} -target ${zig_target} \"$@\"\n")
  else()
    file(WRITE "${wrappers}/zig-${tool}.in" "#!/bin/sh\nexec \"${zig_dir}/zig\" ${tool} \"$@\"\n")
  endif()
  file(COPY_FILE "${wrappers}/zig-${tool}.in" "${wrappers}/zig-${tool}" ONLY_IF_DIFFERENT)
  file(CHMOD "${wrappers}/zig-${tool}" PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE
       GROUP_READ GROUP_EXECUTE WORLD_READ WORLD_EXECUTE)
endforeach()
set(CMAKE_C_COMPILER "${wrappers}/zig-cc")
set(CMAKE_CXX_COMPILER "${wrappers}/zig-c++")
set(CMAKE_AR "${wrappers}/zig-ar" CACHE FILEPATH "")
set(CMAKE_RANLIB "${wrappers}/zig-ranlib" CACHE FILEPATH "")

# Programs (python, nanobind's helpers) run on the build machine.
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
