// The engine's test-only functions: entry points the unit tests use to check one rule or
// kernel (shared memory's placement and spin rules, the staging-store rule, the reduce
// kernels, the TCP links' own-link rule, warn() from an engine thread) without a
// communicator. bindings.cpp registers them through bindTesting(); nothing in torchring's own
// code calls them.
#include <torch/extension.h>

#include <array>
#include <thread>

#include "core/reduce.h"
#include "core/stores.h"
#include "core/tensor.h"
#include "transport/shm/group.h"
#include "transport/tcp/socket.h"

namespace py = pybind11;

namespace torchring {
namespace {

// reduceInto over whole tensors, so unit tests check the kernels' rounding and NaN/inf
// handling against torch without a communicator. dst = srcs[0] op srcs[1] ... .
void reduceTensors(at::Tensor dst, const std::vector<at::Tensor>& srcs, int op, double scale) {
  TORCH_CHECK(!srcs.empty(), "reduce_tensors: srcs is empty");
  std::vector<const void*> ptrs;
  for (const auto& t : srcs) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && t.scalar_type() == dst.scalar_type() &&
                    t.numel() == dst.numel(),
                "reduce_tensors: every source must be a contiguous CPU tensor like dst (",
                dst.scalar_type(), "[", dst.numel(), "]), got ", t.scalar_type(), "[", t.numel(), "]");
    ptrs.push_back(t.data_ptr());
  }
  TORCH_CHECK(dst.is_contiguous() && dst.device().is_cpu(), "reduce_tensors: dst must be a contiguous CPU tensor");
  TORCH_CHECK(op >= 0 && op < kNumReduceOps && op != static_cast<int>(ReduceOp::AVG),
              "reduce_tensors: op must be SUM, MIN, MAX, PRODUCT, BAND, BOR or BXOR (AVG is SUM with scale), got ", op);
  reduceInto(dst.data_ptr(), nullptr, ptrs.data(), static_cast<int>(ptrs.size()),
             static_cast<size_t>(dst.numel()), toDType(dst.scalar_type()), static_cast<ReduceOp>(op), scale);
}

// Shared memory's spin rule (transport/shm/group.cpp) on given CPU sets.
bool cpuSetsSuffice(const std::vector<std::vector<int>>& cpuSets) {
  std::vector<std::array<uint64_t, 16>> masks(cpuSets.size());
  for (size_t i = 0; i < cpuSets.size(); ++i) {
    masks[i].fill(0);
    for (int cpu : cpuSets[i]) {
      TORCH_CHECK_VALUE(cpu >= 0 && cpu < 1024, "_cpu_sets_suffice: CPU ", cpu, " is outside 0-1023");
      masks[i][cpu / 64] |= uint64_t{1} << (cpu % 64);
    }
  }
  return ShmGroup::cpusSuffice(masks);
}

// The staging-store rule (core/stores.h) on given timings: segment i, which copies `bytes` in,
// takes cached_seconds[i] or streaming_seconds[i], in the mode the chooser picks, or
// cold_cached_seconds[i] (when given) for cached stores into a staging buffer whose last
// writes streamed (segments alternate between two buffers); returns the modes picked (True:
// streaming).
std::vector<bool> storeChoices(const std::vector<double>& cachedSeconds, const std::vector<double>& streamingSeconds,
                               size_t bytes, const std::vector<double>& coldCachedSeconds) {
  TORCH_CHECK_VALUE(cachedSeconds.size() == streamingSeconds.size() &&
                        (coldCachedSeconds.empty() || coldCachedSeconds.size() == cachedSeconds.size()),
                    "_store_choices: give one cached and one streaming time per copy (and one cold "
                    "cached time, when any)");
  StoreChooser chooser;
  std::vector<bool> picked;
  bool streamedLast[2] = {false, false};  // how each staging buffer was last written
  for (size_t i = 0; i < cachedSeconds.size(); ++i) {
    const bool stream = chooser.streaming(bytes);
    picked.push_back(stream);
    const bool cold = !stream && streamedLast[i % 2] && !coldCachedSeconds.empty();
    chooser.record(stream, bytes, stream ? streamingSeconds[i] : cold ? coldCachedSeconds[i] : cachedSeconds[i]);
    streamedLast[i % 2] = stream;
  }
  return picked;
}

void streamCopyTensor(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK_VALUE(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes() &&
                        dst.device().is_cpu() && src.device().is_cpu(),
                    "_stream_copy: two contiguous CPU tensors of the same size");
  streamCopy(dst.data_ptr(), src.data_ptr(), src.nbytes());
  streamFence();
}

}  // namespace

void bindTesting(py::module_& m) {
  m.def(
      "warn_from_thread",
      [](const std::string& message) {
        py::gil_scoped_release release;
        std::thread([message] { warn(message); }).join();
      },
      py::arg("message"), "Test-only: warn() from a thread of the engine's own, as the watchdog does.");
  m.def("reduce_tensors", &reduceTensors, py::arg("dst"), py::arg("srcs"), py::arg("op"),
        py::arg("scale") = 1.0, "Test-only: dst = srcs[0] op srcs[1] ... with the engine's kernels.");
  // Shared memory's placement and spin rules (transport/shm/group.cpp).
  m.def("_staging_shifts", &ShmGroup::stagingShifts, py::arg("page_offsets"));
  m.def("_cpu_sets_suffice", &cpuSetsSuffice, py::arg("cpu_sets"));
  m.def("_store_choices", &storeChoices, py::arg("cached_seconds"), py::arg("streaming_seconds"), py::arg("bytes"),
        py::arg("cold_cached_seconds") = std::vector<double>());
  m.def("_stream_copy", &streamCopyTensor, py::arg("dst"), py::arg("src"));
  // The TCP links' own-link rule (transport/tcp/held_by_link.cpp) on a socket of the test's.
  m.def("_send_held_by_link", &tcpsocket::sendHeldByLink, py::arg("fd"));
}

}  // namespace torchring
