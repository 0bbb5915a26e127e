// Umbrella header for the Tessera C++ API.
#pragma once

#include "tessera/attention.hpp"
#include "tessera/backend.hpp"
#include "tessera/cascade.hpp"
#include "tessera/mla.hpp"
#include "tessera/ops.hpp"
#include "tessera/types.hpp"
#include "tessera/version.hpp"
