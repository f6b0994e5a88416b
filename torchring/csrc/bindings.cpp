// The only file that knows about Python: binds the communicator and its handles.
// Every call that can block releases the GIL.
#include <torch/extension.h>

#include <optional>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "communicator.h"
#include "grad_pool.h"
#ifdef TORCHRING_WITH_NCCL
#include "cuda/nccl.h"
#endif

namespace py = pybind11;
using torchring::CommOptions;
using torchring::Communicator;
using torchring::OpKind;
using torchring::ReduceOp;
using torchring::Work;

namespace {

std::shared_ptr<Communicator> makeCommunicator(int rank, int size,
                                               std::vector<std::vector<int>> hosts,
                                               double timeout, size_t chunkBytes,
                                               size_t arenaBytes, int spinIters,
                                               std::string secret) {
  CommOptions o;
  o.rank = rank;
  o.size = size;
  o.hosts = std::move(hosts);
  o.timeoutSec = timeout;
  o.chunkBytes = chunkBytes;
  o.arenaBytes = arenaBytes;
  o.spinIters = spinIters;
  o.secret = std::move(secret);
  return std::make_shared<Communicator>(std::move(o));
}

py::dict buildInfo() {
  py::dict info;
  info["transports"] = py::make_tuple("shm", "tcp");
#ifdef TORCHRING_WITH_NCCL
  info["nccl"] = true;
  info["cuda"] = true;
  info["nccl_version"] = torchring::NcclComm::version();
#else
  info["nccl"] = false;
  info["cuda"] = false;
#endif
#ifdef __FLT16_MAX__
  info["float16_kernel"] = "_Float16";
#else
  info["float16_kernel"] = "c10::Half";
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torchring engine";
  // Engine failures become torchring.TorchringError, a class that exists before any build.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const torchring::TorchringError& e) {
      py::object cls = py::module_::import("torchring._errors").attr("TorchringError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
  m.def("build_info", &buildInfo);

  namespace gradpool = torchring::gradpool;
  m.def("grad_pool_install", &gradpool::install, py::arg("limit_bytes"));
  m.def("grad_pool_begin", &gradpool::begin);
  m.def("grad_pool_end", &gradpool::end, py::arg("task"));
  m.def("grad_pool_stats", [] {
    gradpool::Stats s = gradpool::stats();
    py::dict d;
    d["installed"] = gradpool::installed();
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["evicted"] = s.evicted;
    d["cached_bytes"] = s.cachedBytes;
    d["live_bytes"] = s.liveBytes;
    d["limit_bytes"] = s.limitBytes;
    d["min_bytes"] = s.minBytes;
    d["active_tasks"] = s.activeTasks;
    return d;
  });

#ifdef TORCHRING_WITH_NCCL
  using torchring::NcclComm;
  using torchring::NcclWork;
  m.def("nccl_unique_id", [] { return py::bytes(NcclComm::uniqueId()); });
  py::class_<NcclWork, std::shared_ptr<NcclWork>>(m, "NcclWork")
      .def("wait", &NcclWork::wait, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &NcclWork::synchronize, py::arg("timeout") = 0.0,
           py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &NcclWork::isCompleted);
  py::class_<NcclComm, std::shared_ptr<NcclComm>>(m, "NcclComm")
      .def(py::init<int, int, int, std::string, double>(), py::arg("rank"), py::arg("size"),
           py::arg("device"), py::arg("unique_id"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def("allreduce",
           [](NcclComm& c, at::Tensor t, int op, std::shared_ptr<Work> check) {
             return c.allreduce(t, static_cast<ReduceOp>(op), std::move(check));
           },
           py::arg("tensor"), py::arg("op"), py::arg("check"))
      .def("broadcast", &NcclComm::broadcast, py::arg("tensor"), py::arg("root"), py::arg("check"))
      .def("allgather", &NcclComm::allgather, py::arg("tensor"), py::arg("rows"), py::arg("check"))
      .def("reduce_scatter",
           [](NcclComm& c, at::Tensor t, int op, std::shared_ptr<Work> check) {
             return c.reduceScatter(t, static_cast<ReduceOp>(op), std::move(check));
           },
           py::arg("tensor"), py::arg("op"), py::arg("check"))
      .def("abort", &NcclComm::abort, py::call_guard<py::gil_scoped_release>())
      .def("drain", &NcclComm::drain, py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("close", &NcclComm::close, py::call_guard<py::gil_scoped_release>());
#endif

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("wait", &Work::wait, py::arg("timeout") = 0.0, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &Work::isCompleted)
      .def_property_readonly("seq", &Work::seq);

  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init(&makeCommunicator), py::arg("rank"), py::arg("size"), py::arg("hosts"),
           py::arg("timeout"), py::arg("chunk_bytes"), py::arg("arena_bytes"),
           py::arg("spin_iters"), py::arg("secret"))
      .def("create_shm", &Communicator::createShm, py::call_guard<py::gil_scoped_release>())
      .def("listen", &Communicator::listen, py::call_guard<py::gil_scoped_release>())
      .def("attach_shm", &Communicator::attachShm, py::call_guard<py::gil_scoped_release>())
      .def("unlink_shm", &Communicator::unlinkShm)
      .def("connect_ring", &Communicator::connectRing, py::call_guard<py::gil_scoped_release>())
      .def("start", &Communicator::start)
      .def(
          "set_failure_board",
          [](Communicator& c, c10::intrusive_ptr<c10d::Store> store) {
            torchring::FailureBoard board;
            board.post = [store](int rank, const std::string& message) {
              store->set("failed/" + std::to_string(rank),
                         std::vector<uint8_t>(message.begin(), message.end()));
            };
            board.read = [store](int rank) {
              std::string key = "failed/" + std::to_string(rank);
              if (!store->check({key})) return std::string();
              auto value = store->get(key);
              return std::string(value.begin(), value.end());
            };
            c.setFailureBoard(std::move(board));
          },
          py::arg("store"))
      .def("shutdown", &Communicator::shutdown, py::call_guard<py::gil_scoped_release>())
      .def(
          "submit",
          [](Communicator& c, int kind, std::optional<at::Tensor> tensor, int op, int root,
             bool runInline) {
            at::Tensor t = tensor.has_value() ? *tensor : at::Tensor();
            py::gil_scoped_release release;
            return c.submit(static_cast<OpKind>(kind), std::move(t), static_cast<ReduceOp>(op),
                            root, runInline);
          },
          py::arg("kind"), py::arg("tensor"), py::arg("op"), py::arg("root"), py::arg("inline"))
      .def(
          "submit_check",
          [](Communicator& c, int kind, at::Tensor like, int op, int root) {
            py::gil_scoped_release release;
            return c.submitCheck(static_cast<OpKind>(kind), like, static_cast<ReduceOp>(op), root);
          },
          py::arg("kind"), py::arg("like"), py::arg("op"), py::arg("root"))
      .def(
          "empty_shared",
          [](Communicator& c, std::vector<int64_t> sizes, at::ScalarType dtype) -> py::object {
            at::Tensor t = c.emptyShared(sizes, dtype);
            if (!t.defined()) return py::none();
            return py::cast(t);
          })
      .def_property_readonly("local_index", &Communicator::localIndex)
      .def_property_readonly("local_size", &Communicator::localSize)
      .def_property_readonly("host_index", &Communicator::hostIndex)
      .def_property_readonly("num_hosts", &Communicator::numHosts)
      .def_property_readonly("is_leader", &Communicator::isLeader)
      .def_property_readonly("has_shm", &Communicator::hasShm);
}
