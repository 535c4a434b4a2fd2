// Everything MSL code sees, for compiling Metal kernel sources as C++17.
// All standard headers come first: the address-space keywords below are
// macros, and `thread` or `device` must not reach the standard library.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "emu/bind.h"
#include "emu/runtime.h"
#include "emu/stdlib.h"
#include "emu/sync.h"

#define METAL_FUNC inline
#define __METAL_VERSION__ 310
#define __HAVE_BFLOAT__ 1
#define __METAL__ 1

// Address spaces. The run build drops them; the type-check build (compiled,
// never run) gives each its own clang address space, so that a pointer
// assigned across spaces is rejected as Apple's compiler rejects it.
// `threadgroup` becomes a marker that the driver rewrites: a threadgroup
// variable declared in a kernel is shared by the threadgroup's threads.
#ifdef EMU_TYPECHECK
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#else
#define device
#define constant
#endif
#define thread
#define threadgroup __emu_threadgroup
#define ray_data

using namespace metal;
