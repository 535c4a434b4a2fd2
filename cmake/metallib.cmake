# cmake -DSOURCE=x.metal -DOUTPUT=x.metallib -DMIN_MACOS=14.0 -DSTAMP=s -P metallib.cmake
# Compiles one Metal source into a metallib with Xcode's compiler. A failure is
# a warning, not an error: the module then compiles the embedded source at run
# time (or reports why it cannot).
get_filename_component(_dir "${OUTPUT}" DIRECTORY)
set(_air "${_dir}/flash_cce.air")
file(REMOVE "${OUTPUT}" "${_air}")
execute_process(
  COMMAND xcrun -sdk macosx metal -fno-fast-math -Wall -mmacosx-version-min=${MIN_MACOS}
          -c "${SOURCE}" -o "${_air}"
  RESULT_VARIABLE _rc ERROR_VARIABLE _err)
if(_rc EQUAL 0)
  execute_process(
    COMMAND xcrun -sdk macosx metallib "${_air}" -o "${OUTPUT}"
    RESULT_VARIABLE _rc ERROR_VARIABLE _err)
endif()
if(NOT _rc EQUAL 0)
  file(REMOVE "${OUTPUT}")
  message(WARNING "flash_cce.metallib was not built (the module will compile the "
                  "kernels' source at run time instead):\n${_err}")
endif()
file(WRITE "${STAMP}" "${_rc}\n")
