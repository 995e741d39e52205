// The dcplan version, from the CMake project version.
#pragma once

#ifndef DCPLAN_VERSION
#error "DCPLAN_VERSION must be defined by the build"
#endif
