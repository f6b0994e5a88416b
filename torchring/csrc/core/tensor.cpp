// The engine's tensor vocabulary (tensor.h).
#include "core/tensor.h"

#include <algorithm>

namespace torchring {

bool engineDType(at::ScalarType type, DType* dtype) {
  switch (type) {
    case at::kFloat: *dtype = DType::F32; return true;
    case at::kDouble: *dtype = DType::F64; return true;
    case at::kHalf: *dtype = DType::F16; return true;
    case at::kBFloat16: *dtype = DType::BF16; return true;
    case at::kChar: *dtype = DType::I8; return true;
    case at::kByte: *dtype = DType::U8; return true;
    case at::kInt: *dtype = DType::I32; return true;
    case at::kLong: *dtype = DType::I64; return true;
    case at::kShort: *dtype = DType::I16; return true;
    case at::kBool: *dtype = DType::BOOL; return true;
    default: return false;
  }
}

DType toDType(at::ScalarType type) {
  DType dtype;
  TORCH_CHECK_VALUE(engineDType(type, &dtype), "torchring does not support dtype ", c10::toString(type));
  return dtype;
}

std::string tensorText(const at::Tensor& tensor) {
  std::string text = dtypeName(toDType(tensor.scalar_type()));
  text += "[";
  for (int64_t d = 0; d < tensor.dim(); ++d) text += (d ? ", " : "") + std::to_string(tensor.size(d));
  return text + "]";
}

int64_t rowsOf(int64_t rows, int size, int rank) { return rows / size + (rank < rows % size ? 1 : 0); }

int64_t firstRowOf(int64_t rows, int size, int rank) {
  return rank * (rows / size) + std::min<int64_t>(rank, rows % size);
}

}  // namespace torchring
