// The engine's tensor vocabulary: how a torch tensor's dtype maps to the engine's DType, how
// messages name a tensor, and how an uneven reduce_scatter splits rows. Shared by the
// communicator, the NCCL path and the bindings.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "core/common.h"

namespace torchring {

// The engine's DType of a torch dtype: false for one the engine does not move.
bool engineDType(at::ScalarType type, DType* dtype);
// The same; a dtype torchring does not support is a ValueError (bad input) naming it.
DType toDType(at::ScalarType type);
// "float32[10, 4]": a tensor as messages name it (Python's torchring._core.types.describe).
std::string tensorText(const at::Tensor& tensor);
// Rows of an uneven reduce_scatter: rank r gets rows/size rows, one more when r < rows % size.
int64_t rowsOf(int64_t rows, int size, int rank);
int64_t firstRowOf(int64_t rows, int size, int rank);

}  // namespace torchring
