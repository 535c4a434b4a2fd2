// A stand-in for Apple's CoreFoundation header that exists only for the macOS
// compile check run on Linux (zig's macOS target ships no SDK frameworks).
// metal-cpp uses two of its names. A build on a Mac uses the SDK's header and
// never sees this file.
#pragma once

typedef double CFTimeInterval;
typedef const struct __CFString* CFStringRef;

#ifdef __cplusplus
extern "C" {
#endif
CFStringRef __CFStringMakeConstantString(const char* c_str);
#ifdef __cplusplus
}
#endif
