// A stand-in for Apple's IOSurface header that exists only for the macOS
// compile check run on Linux (see ../CoreFoundation/CoreFoundation.h):
// metal-cpp's texture declarations name the type.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
