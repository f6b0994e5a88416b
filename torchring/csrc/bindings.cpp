// With bindings_testing.cpp, the only files that know about Python (tests/unit checks it):
// binds the communicator, its options and handles, the engine's exceptions and enums. Every
// call that can block releases the GIL.
#include <torch/extension.h>

#include <optional>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "c10d/backend.h"
#include "engine/communicator.h"
#include "memory/grad_pool.h"
#ifdef TORCHRING_WITH_NCCL
#include "cuda/nccl.h"
#endif

namespace py = pybind11;

namespace torchring {
void bindTesting(py::module_& m);  // bindings_testing.cpp
void bindSchedules(py::module_& m);  // bindings_schedule.cpp
void bindTrace(py::module_& m);  // bindings_trace.cpp
// Records the caller's Python frame for the calling thread's next operation on `comm` (while
// the flight recorder takes frames), looking from `depth` calls out (1: past the Python
// function that called the binding); call with the GIL held (bindings_trace.cpp).
void noteCaller(const Communicator& comm, int depth = 0);
}  // namespace torchring

using torchring::CommOptions;
using torchring::Communicator;
using torchring::OpKind;
using torchring::ReduceOp;
using torchring::Work;

namespace {

// Raises the Python class of torchring._core.errors named `name` with `what` as its message.
void raise(const char* name, const char* what) {
  py::object cls = py::module_::import("torchring._core.errors").attr(name);
  PyErr_SetString(cls.ptr(), what);
}

// allreduce's common call (collectives/basic.py) as a plain CPython function: pybind's dispatcher
// (argument casters, the type lookup of `self`, the call record) costs about a quarter of a
// world-1 call, which is all overhead. `self` is a capsule owning a reference to the
// communicator; (tensor, op) -> True when the engine ran it (the answer and the errors are
// those of Communicator::allreduceNow; a non-tensor is declined).
constexpr const char* kCommCapsule = "torchring.Communicator";

PyObject* allreduceNowFast(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* comm = static_cast<std::shared_ptr<Communicator>*>(PyCapsule_GetPointer(self, kCommCapsule));
  if (comm == nullptr) return nullptr;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "allreduce_now(tensor, op) takes 2 positional arguments");
    return nullptr;
  }
  if (!THPVariable_Check(args[0])) Py_RETURN_FALSE;
  const long op = PyLong_AsLong(args[1]);
  if (op == -1 && PyErr_Occurred()) return nullptr;
  // A reference taken while the GIL is held: the engine's own copies of the tensor then move its
  // count between 2 and 3, never across 1 <-> 2, the step at which torch increfs or decrefs the
  // tensor's Python object and so takes the GIL (twice a call, ~0.1 µs, with it released).
  const at::Tensor tensor = THPVariable_Unpack(args[0]);
  bool ran = false;
  torchring::noteCaller(**comm, 1);  // past torchring.allreduce, which called this
  try {
    py::gil_scoped_release release;
    ran = (*comm)->allreduceNow(tensor, static_cast<int>(op));
  } catch (...) {  // the GIL is back: the release ended with its scope
    py::detail::try_translate_exceptions();
    return nullptr;
  }
  return PyBool_FromLong(ran);
}

PyMethodDef kAllreduceNowDef = {"allreduce_now", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&allreduceNowFast)),
                                METH_FASTCALL, "allreduce_now(tensor, op) -> bool: the engine ran the allreduce"};

py::object allreduceNowFunction(std::shared_ptr<Communicator> comm) {
  auto* owned = new std::shared_ptr<Communicator>(std::move(comm));
  PyObject* capsule = PyCapsule_New(owned, kCommCapsule, [](PyObject* c) {
    delete static_cast<std::shared_ptr<Communicator>*>(PyCapsule_GetPointer(c, kCommCapsule));
  });
  if (capsule == nullptr) {
    delete owned;
    throw py::error_already_set();
  }
  PyObject* function = PyCFunction_New(&kAllreduceNowDef, capsule);
  Py_DECREF(capsule);  // the function holds it
  if (function == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(function);
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
  // Engine exceptions become the classes of the same role in torchring._core.errors (which exist
  // before any build); most derived first.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const torchring::MismatchError& e) {
      raise("CollectiveMismatchError", e.what());
    } catch (const torchring::CommFailedError& e) {
      raise("CommunicatorFailedError", e.what());
    } catch (const torchring::WaitTimeoutError& e) {
      raise("WaitTimeoutError", e.what());
    } catch (const torchring::TorchringError& e) {
      raise("TorchringError", e.what());
    }
  });
  m.def("build_info", &buildInfo);
  m.def("allreduce_now_function", &allreduceNowFunction, py::arg("comm"));
  // torch.distributed's backend over `comm` (c10d/backend.h); torch.distributed must be
  // imported first, so that the c10d Backend type it returns is known to pybind.
  m.def(
      "make_c10d_backend",
      [](std::shared_ptr<Communicator> comm, int rank, int size, std::string label) {
        return c10::intrusive_ptr<c10d::Backend>(
            c10::make_intrusive<torchring::C10dBackend>(std::move(comm), rank, size, std::move(label)));
      },
      py::arg("comm"), py::arg("rank"), py::arg("size"), py::arg("label") = "");
  // warn() from any engine thread reaches `sink` (the "torchring" logger) with the GIL held;
  // while the interpreter finalizes, or if the sink raises, the message goes to stderr. None
  // restores stderr: torchring clears the sink at exit, after shutdown() stopped the threads.
  m.def(
      "set_warning_sink",
      [](py::object sink) {
        if (sink.is_none()) return torchring::setWarningSink({});
        auto* keep = new py::function(sink.cast<py::function>());  // leaked: engine threads may outlive it
        torchring::setWarningSink([keep](const std::string& message) {
#if PY_VERSION_HEX >= 0x030D0000
          const bool finalizing = Py_IsFinalizing();
#else
          const bool finalizing = _Py_IsFinalizing();
#endif
          if (Py_IsInitialized() && !finalizing) {
            py::gil_scoped_acquire gil;
            try {
              (*keep)(message);
              return;
            } catch (py::error_already_set& e) {
              e.discard_as_unraisable("torchring warning sink");
            }
          }
          std::fprintf(stderr, "torchring: %s\n", message.c_str());
        });
      },
      py::arg("sink"));
  // The engine's enums by name and value; torchring._core.types checks its mirror against them.
  py::dict reduceOps, opKinds;
  for (int i = 0; i < torchring::kNumReduceOps; ++i) {
    reduceOps[torchring::opName(static_cast<ReduceOp>(i))] = i;
  }
  for (int i = 0; i < torchring::kNumOpKinds; ++i) {
    opKinds[py::str(torchring::kindName(static_cast<OpKind>(i))).attr("upper")()] = i;
  }
  py::list dtypes;
  for (int i = 0; i < torchring::kNumDTypes; ++i) dtypes.append(torchring::dtypeName(static_cast<torchring::DType>(i)));
  m.attr("REDUCE_OPS") = reduceOps;
  m.attr("OP_KINDS") = opKinds;
  m.attr("DTYPES") = dtypes;
  py::dict opSpecs;  // each kind's OpSpec row (core/common.h) by OP_KINDS' names; torchring._core.types checks it too
  for (int i = 0; i < torchring::kNumOpKinds; ++i) {
    const torchring::OpSpec& s = torchring::opSpec(static_cast<OpKind>(i));
    opSpecs[py::str(s.name).attr("upper")()] = py::dict(
        py::arg("reduces") = s.reduces, py::arg("rooted") = s.rooted, py::arg("scalable") = s.scalable,
        py::arg("in_place") = s.inPlace, py::arg("nccl") = s.nccl, py::arg("ragged") = s.ragged);
  }
  m.attr("OP_SPECS") = opSpecs;
  torchring::bindTesting(m);  // the unit tests' entry points (bindings_testing.cpp)
  torchring::bindSchedules(m);
  torchring::bindTrace(m);  // the flight recorder (bindings_trace.cpp)  // the cross-host schedules and cost model (bindings_schedule.cpp)
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

  // One handle type for every path (NcclWork derives from it); virtual wait/synchronize.
  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("wait", &Work::wait, py::arg("timeout") = 0.0, py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &Work::synchronize, py::arg("timeout") = 0.0,
           py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &Work::isCompleted, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("seq", &Work::seq);
  py::class_<torchring::CpuWork, Work, std::shared_ptr<torchring::CpuWork>>(m, "CpuWork")
      .def_property_readonly("source", &torchring::CpuWork::source);

  py::class_<CommOptions>(m, "CommOptions", "What a Communicator is made from (engine/communicator.h).")
      .def(py::init<>())
      .def_readwrite("rank", &CommOptions::rank, "this process's rank in [0, size)")
      .def_readwrite("size", &CommOptions::size, "number of ranks")
      .def_readwrite("hosts", &CommOptions::hosts,
                     "ranks of each host, hosts by smallest rank, ranks ascending; "
                     "the first rank of a host is its leader")
      .def_readwrite("timeout", &CommOptions::timeoutSec,
                     "seconds an operation may make no progress before it fails")
      .def_readwrite("segment_bytes", &CommOptions::segmentBytes,
                     "shared-memory staging segment per rank (two per rank)")
      .def_readwrite("arena_bytes", &CommOptions::arenaBytes,
                     "virtual size of this rank's shared-memory arena; 0 for none")
      .def_readwrite("spin_auto", &CommOptions::spinAuto,
                     "spin_iters is the default: shared memory picks its own from the CPU sets")
      .def_readwrite("spin_iters", &CommOptions::spinIters,
                     "busy-wait iterations before a waiting rank sleeps")
      .def_readwrite("secret", &CommOptions::secret, "per-job token every TCP handshake presents")
      .def_readwrite("label", &CommOptions::label, "put in front of failure messages (a group's)")
      .def_readwrite("trace_entries", &CommOptions::traceEntries, "operations the flight recorder keeps (0: none)")
      .def_readwrite("trace_name", &CommOptions::traceName, "the group's name in flight-recorder dumps")
      .def_readwrite("trace_desc", &CommOptions::traceDesc, "the group's description in flight-recorder dumps")
      .def_readwrite("trace_ranks", &CommOptions::traceRanks, "the group's world ranks in dumps (empty: all)")
      .def_readwrite("straggler_sec", &CommOptions::stragglerSec, "the persistent-lateness warning's threshold (0: off)")
      .def_readwrite("host_names", &CommOptions::hostNames, "each host's name, by host index, for messages")
      .def_readwrite("one_shot_bytes", &CommOptions::oneShotBytes,
                     "internal, for tests: largest staged shared-memory allreduce run one-shot")
      .def_readwrite("staging_stores", &CommOptions::stagingStores,
                     "stores for shared-memory staging writes: 0 auto (measured), 1 cached, 2 streaming")
      .def_readwrite("algo", &CommOptions::algo,
                     "the algorithm among hosts (ALGOS index; 0: the cost model chooses per operation)")
      .def_readwrite("levels", &CommOptions::levels, "with algo rabenseifner: its halvings (0: all)")
      .def_readwrite("header", &CommOptions::header,
                     "the header exchange's shape (ALGOS index of doubling or multiplying; 0: the cost model's)");

#ifdef TORCHRING_WITH_NCCL
  using torchring::NcclComm;
  using torchring::NcclWork;
  m.def("nccl_unique_id", [] { return py::bytes(NcclComm::uniqueId()); });
  py::class_<NcclWork, Work, std::shared_ptr<NcclWork>>(m, "NcclWork");
  py::class_<NcclComm, std::shared_ptr<NcclComm>>(m, "NcclComm")
      .def(py::init<int, int, int, std::string, double>(), py::arg("rank"), py::arg("size"),
           py::arg("device"), py::arg("unique_id"), py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>())
      .def(py::init<NcclComm&, std::vector<int>, bool, double>(), py::arg("parent"), py::arg("exclude"),
           py::arg("parent_failed"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def_static("shrink_supported", &NcclComm::shrinkSupported)
      .def_property_readonly("rank", &NcclComm::rank)
      .def_property_readonly("size", &NcclComm::size)
      .def("failed", &NcclComm::failed, py::call_guard<py::gil_scoped_release>())
      .def("allreduce",
           [](NcclComm& c, at::Tensor t, int op, std::shared_ptr<torchring::CpuWork> check) {
             return c.allreduce(t, static_cast<ReduceOp>(op), std::move(check));
           },
           py::arg("tensor"), py::arg("op"), py::arg("check"), py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &NcclComm::broadcast, py::arg("tensor"), py::arg("root"), py::arg("check"),
           py::call_guard<py::gil_scoped_release>())
      .def("allgather", &NcclComm::allgather, py::arg("tensor"), py::arg("rows"), py::arg("check"),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter",
           [](NcclComm& c, at::Tensor t, int op, std::shared_ptr<torchring::CpuWork> check) {
             return c.reduceScatter(t, static_cast<ReduceOp>(op), std::move(check));
           },
           py::arg("tensor"), py::arg("op"), py::arg("check"), py::call_guard<py::gil_scoped_release>())
      .def("abort", &NcclComm::abort, py::call_guard<py::gil_scoped_release>())
      .def("drain", &NcclComm::drain, py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("close", &NcclComm::close, py::call_guard<py::gil_scoped_release>());
#endif


  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init<CommOptions>(), py::arg("options"))
      .def("create_shm", &Communicator::createShm, py::call_guard<py::gil_scoped_release>())
      .def("listen", &Communicator::listen, py::call_guard<py::gil_scoped_release>())
      .def("attach_shm", &Communicator::attachShm, py::call_guard<py::gil_scoped_release>())
      .def("unlink_shm", &Communicator::unlinkShm)
      .def("connect_links", &Communicator::connectLinks, py::arg("addrs"), py::arg("ports"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "measure_links",
          [](Communicator& c) {
            torchring::LinkCost cost;
            {
              py::gil_scoped_release release;
              cost = c.measureLinks();
            }
            return py::make_tuple(cost.alpha, cost.beta, cost.gamma, groupAlpha(cost));
          },
          "(alpha, beta, gamma, alpha_group) of this leader's links and host (every leader at once)")
      .def(
          "set_link_cost",
          [](Communicator& c, double alpha, double beta, double gamma, double alphaGroup) {
            c.setLinkCost({alpha, beta, gamma, alphaGroup});
          },
          py::arg("alpha"), py::arg("beta"), py::arg("gamma"), py::arg("alpha_group") = 0.0)
      .def("allreduce_algorithm", &Communicator::allreduceAlgoOf, py::arg("tensor"))
      .def_property("algo", &Communicator::forcedAlgo, &Communicator::setForcedAlgo,
                    "the forced algorithm among hosts (ALGOS index, 0: auto); set only between operations")
      .def_property("levels", &Communicator::forcedLevels, &Communicator::setForcedLevels,
                    "with the forced algorithm rabenseifner: its halvings (0: all); set only between operations")
      .def_property_readonly("link_cost",
                             [](const Communicator& c) {
                               const auto& cost = c.linkCost();
                               return py::make_tuple(cost.alpha, cost.beta, cost.gamma, groupAlpha(cost));
                             })
      .def("start", &Communicator::start)
      .def(
          "set_failure_board",
          [](Communicator& c, c10::intrusive_ptr<c10d::Store> store, const std::string& where) {
            torchring::FailureBoard board;
            if (!where.empty()) board.where = where;
            board.post = [store](int rank, const std::string& message) {
              const std::vector<uint8_t> bytes(message.begin(), message.end());
              store->set("failed/" + std::to_string(rank), bytes);
              store->set("failed/latest", bytes);
            };
            board.latest = [store] {
              if (!store->check({"failed/latest"})) return std::string();
              auto value = store->get("failed/latest");
              return std::string(value.begin(), value.end());
            };
            board.read = [store](int rank) {
              std::string key = "failed/" + std::to_string(rank);
              if (!store->check({key})) return std::string();
              auto value = store->get(key);
              return std::string(value.begin(), value.end());
            };
            c.setFailureBoard(std::move(board));
          },
          py::arg("store"), py::arg("where") = "")
      .def("shutdown", &Communicator::shutdown, py::call_guard<py::gil_scoped_release>())
      .def("abort", &Communicator::abort, py::arg("why"), py::call_guard<py::gil_scoped_release>())
      .def("failure", &Communicator::failure, py::call_guard<py::gil_scoped_release>())
      .def("waited_seconds", &Communicator::waitedSeconds,
           "seconds this rank waited for each rank (by rank) since the communicator started")
      .def("own_link_seconds", &Communicator::ownLinkSeconds,
           "seconds this rank waited while its own link held its sent bytes back")
      .def(
          "submit",
          [](Communicator& c, int kind, std::optional<at::Tensor> tensor, int op, int root, bool runInline,
             std::optional<at::Tensor> out, std::vector<at::Tensor> tensors, double prescale, double postscale,
             std::optional<at::Tensor> sendSplits, std::optional<at::Tensor> recvSplits, bool recvSplitsKnown) {
            TORCH_CHECK_VALUE(kind >= 0 && kind < torchring::kNumOpKinds && kind != static_cast<int>(OpKind::SEND) &&
                                  kind != static_cast<int>(OpKind::RECV),
                              "submit: unknown collective kind ", kind);
            TORCH_CHECK_VALUE(op >= 0 && op < torchring::kNumReduceOps, "submit: unknown reduce op ", op);
            at::Tensor t = tensor.has_value() ? *tensor : at::Tensor();
            torchring::OpArgs args;
            args.out = out.has_value() ? *out : at::Tensor();
            args.tensors = std::move(tensors);
            args.prescale = prescale;
            args.postscale = postscale;
            args.sendSplits = sendSplits.has_value() ? *sendSplits : at::Tensor();
            args.recvSplits = recvSplits.has_value() ? *recvSplits : at::Tensor();
            args.recvSplitsKnown = recvSplitsKnown;
            torchring::noteCaller(c);
            py::gil_scoped_release release;
            return c.submit(static_cast<OpKind>(kind), std::move(t), static_cast<ReduceOp>(op), root, runInline,
                            std::move(args));
          },
          py::arg("kind"), py::arg("tensor"), py::arg("op"), py::arg("root"), py::arg("inline"), py::kw_only(),
          py::arg("out") = py::none(), py::arg("tensors") = std::vector<at::Tensor>(), py::arg("prescale") = 1.0,
          py::arg("postscale") = 1.0, py::arg("send_splits") = py::none(), py::arg("recv_splits") = py::none(),
          py::arg("recv_splits_known") = false)
      .def(
          "send",
          [](Communicator& c, at::Tensor tensor, int peer, int64_t tag) {
            torchring::noteCaller(c);
            py::gil_scoped_release release;
            return c.send(std::move(tensor), peer, tag);
          },
          py::arg("tensor"), py::arg("peer"), py::arg("tag"))
      .def(
          "recv",
          [](Communicator& c, at::Tensor tensor, int peer, int64_t tag) {
            torchring::noteCaller(c);
            py::gil_scoped_release release;
            return c.recv(std::move(tensor), peer, tag);
          },
          py::arg("tensor"), py::arg("peer"), py::arg("tag"))
      .def("listen_p2p", &Communicator::listenP2P, py::arg("bind_addr"), py::call_guard<py::gil_scoped_release>())
      .def("set_p2p_peers", &Communicator::setP2PPeers, py::arg("addrs"), py::arg("ports"))
      .def(
          "submit_check",
          [](Communicator& c, int kind, at::Tensor like, int op, int root) {
            torchring::noteCaller(c);
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
