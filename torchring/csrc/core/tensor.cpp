// The engine's tensor vocabulary (tensor.h).
#include "core/tensor.h"

#include <algorithm>

namespace torchring {

DType toDType(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kChar: return DType::I8;
    case at::kByte: return DType::U8;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kShort: return DType::I16;
    case at::kBool: return DType::BOOL;
    default:
      TORCH_CHECK_VALUE(false, "torchring does not support dtype ", c10::toString(type));
  }
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
