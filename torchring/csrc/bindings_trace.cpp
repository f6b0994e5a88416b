// The flight recorder's Python side (engine/flight_recorder.h): the Python frame each operation
// is recorded with, the snapshot torchring/trace dumps, and the failure notification fd.
//
// A frame is interned once per (code object, instruction): captureFrame() walks from the
// caller's frame outwards past every frame whose file lies under a skipped prefix (torchring's
// and torch's own packages), and gives the first other frame's (file, line, function) an id in
// the engine's frame table; its line is computed only then. Both caches hold their code
// objects for the life of the process, so a pointer is never reused for another code object
// while it is a key; past kMaxCached entries frames are no longer interned and operations
// record no frame (0). The last walk's instructions answer the next call from the same place
// (KeptWalk) without a lookup.
#include <torch/extension.h>

#include <frameobject.h>

// On CPython 3.11 the frames are read where the interpreter keeps them (its internal frame
// records, the same ones sys._getframe walks): no call into sys, no frame object made, about a
// fifth of the cost. Other versions call sys._getframe.
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#define TORCHRING_INTERPRETER_FRAMES 1
#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <unordered_map>

#include "engine/communicator.h"
#include "engine/flight_recorder.h"
#include "engine/progress_meter.h"

namespace py = pybind11;

namespace torchring {
namespace {

constexpr size_t kMaxCached = 1 << 14;

struct CodeLine {
  PyCodeObject* code;
  int line;
  bool operator==(const CodeLine& o) const { return code == o.code && line == o.line; }
};
struct CodeLineHash {
  size_t operator()(const CodeLine& k) const {
    return std::hash<const void*>()(k.code) * 31 + static_cast<size_t>(k.line);
  }
};

struct FrameCache {
  std::vector<std::string> skipPrefixes;
  std::unordered_map<PyCodeObject*, bool> skip;             // code object -> its file is skipped
  std::unordered_map<CodeLine, uint32_t, CodeLineHash> ids;  // (code object, line) -> frame id
};

std::atomic<bool> gFramesOn{false};  // set once Python gave the prefixes (torchring/trace armed)

FrameCache& cache() {
  static auto* c = new FrameCache();  // used with the GIL held; never destroyed
  return *c;
}

bool skipped(PyCodeObject* code) {
  auto& c = cache();
  auto it = c.skip.find(code);
  if (it != c.skip.end()) return it->second;
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  if (file == nullptr) {
    PyErr_Clear();
    return true;
  }
  bool skip = false;
  for (const auto& prefix : c.skipPrefixes) skip = skip || std::strncmp(file, prefix.c_str(), prefix.size()) == 0;
  if (c.skip.size() < kMaxCached) {
    Py_INCREF(code);
    c.skip.emplace(code, skip);
  }
  return skip;
}

#ifndef TORCHRING_INTERPRETER_FRAMES
// The frame `depth` calls out from the running Python function, as sys._getframe(depth) finds
// it: frames nearer than that are walked past without being made into frame objects (one per
// call of torchring's own wrapper would be allocated, tracked by the garbage collector and freed
// on every operation). Null, with no error set, when the stack is not that deep.
PyFrameObject* frameAt(int depth) {
  static PyObject* getframe = PySys_GetObject("_getframe");  // borrowed from sys, which outlives us
  if (getframe == nullptr) return nullptr;
  PyObject* arg = PyLong_FromLong(depth);
  PyObject* frame = PyObject_CallOneArg(getframe, arg);
  Py_DECREF(arg);
  if (frame == nullptr) PyErr_Clear();
  return reinterpret_cast<PyFrameObject*>(frame);
}

int lastiOf(PyFrameObject* frame) {
#if PY_VERSION_HEX >= 0x030B0000
  return PyFrame_GetLasti(frame);
#else
  return frame->f_lasti * 2;  // 3.10 counts code units of 2 bytes
#endif
}
#endif

// (code object, instruction offset in bytes) -> its frame id, interned on first sight (0: the
// caches are full).
uint32_t frameId(PyCodeObject* code, int at) {
  auto& c = cache();
  const CodeLine key{code, at};
  auto it = c.ids.find(key);
  if (it != c.ids.end()) return it->second;
  if (c.ids.size() >= kMaxCached || c.skip.count(code) == 0) return 0;  // the code object is not held
  const char* file = PyUnicode_AsUTF8(code->co_filename);
  const char* name = PyUnicode_AsUTF8(code->co_name);
  if (file == nullptr || name == nullptr) {
    PyErr_Clear();
    return 0;
  }
  const uint32_t id = FlightRecorder::addFrame(TraceFrame{file, PyCode_Addr2Line(code, at), name});
  c.ids.emplace(key, id);
  return id;
}

// A loop issues its operations from the same place: the last answer, without the lookups (the
// code object is held by the caches, so its address names no other code).
CodeLine gLast{nullptr, 0};
uint32_t gLastId = 0;

// The id of the frame running `code` at byte offset `at` when it lies outside the skipped
// packages; -1 when it lies inside them (the walk goes on outwards).
int64_t idOrSkip(PyCodeObject* code, int at) {
  if (code == gLast.code && at == gLast.line) return gLastId;
  if (skipped(code)) return -1;
  const uint32_t id = frameId(code, at);
  if (id != 0) gLast = CodeLine{code, at}, gLastId = id;
  return id;
}

// The id of the first frame, from `depth` calls out, outside the skipped packages (0: none).
// Needs the GIL.
#ifdef TORCHRING_INTERPRETER_FRAMES
// A frame still setting itself up (its first instructions not run) is passed over, as
// sys._getframe passes over it.
_PyInterpreterFrame* complete(_PyInterpreterFrame* frame) {
  while (frame != nullptr && _PyFrame_IsIncomplete(frame)) frame = frame->previous;
  return frame;
}

// The last walk that found its answer `depth` calls out without passing a frame by: the
// instruction each frame from the running one out to the answer was at, and the answer. Each
// of those code objects is held (the skip cache), so no other code's instruction has any of
// these addresses, and each was past its code's first traceable instruction: a frame found at
// one of them runs that code there, and is complete. So a call from the same place, through
// the same instructions, is answered by one load of each frame's instruction, and a loop's
// next operation reads no code object (a 4 KiB allreduce through the engine's call at world 2
// went from 1.037 to 1.021 of the non-recording one: benchmarks/RESULTS.md).
constexpr int kKeptDepth = 3;
struct KeptWalk {
  int depth = -1;
  const _Py_CODEUNIT* at[kKeptDepth + 1] = {};
  uint32_t id = 0;
};
KeptWalk gKept;

bool pastStart(const _PyInterpreterFrame* frame) {
  return frame->prev_instr >= _PyCode_CODE(frame->f_code) + frame->f_code->_co_firsttraceable;
}

// Keeps the walk from `current` that found `found`, `depth` calls out, with id `id`, when no
// frame on the way was passed by and every frame can be held.
void keepWalk(_PyInterpreterFrame* current, int depth, _PyInterpreterFrame* found, uint32_t id) {
  if (depth > kKeptDepth) return;
  KeptWalk walk;
  _PyInterpreterFrame* frame = current;
  for (int i = 0; i <= depth; ++i, frame = frame->previous) {
    if (frame == nullptr || !pastStart(frame)) return;
    skipped(frame->f_code);  // holds it, while the cache has room
    if (cache().skip.count(frame->f_code) == 0) return;
    walk.at[i] = frame->prev_instr;
    if (i == depth && frame != found) return;
  }
  walk.depth = depth;
  walk.id = id;
  gKept = walk;
}

uint32_t captureFrame(int depth) {
  _PyInterpreterFrame* const current = PyThreadState_Get()->cframe->current_frame;
  if (depth == gKept.depth) {
    int i = 0;
    for (_PyInterpreterFrame* f = current; f != nullptr && f->prev_instr == gKept.at[i]; f = f->previous, ++i) {
      if (i == depth) return gKept.id;
    }
  }
  _PyInterpreterFrame* frame = complete(current);
  for (int i = 0; i < depth && frame != nullptr; ++i) frame = complete(frame->previous);
  for (_PyInterpreterFrame* const first = frame; frame != nullptr; frame = complete(frame->previous)) {
    const int64_t id = idOrSkip(frame->f_code, _PyInterpreterFrame_LASTI(frame) * int(sizeof(_Py_CODEUNIT)));
    if (id < 0) continue;
    if (id > 0 && frame == first) keepWalk(current, depth, frame, static_cast<uint32_t>(id));
    return static_cast<uint32_t>(id);
  }
  return 0;
}
#else
uint32_t captureFrame(int depth) {
  PyFrameObject* frame = frameAt(depth);  // new reference
  uint32_t id = 0;
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    const int64_t found = idOrSkip(code, lastiOf(frame));
    Py_DECREF(code);
    if (found >= 0) {
      id = static_cast<uint32_t>(found);
      break;
    }
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  return id;
}
#endif

// For operations a thread without the GIL queues (torch.distributed's calls, which release
// it): takes the GIL only on a thread Python knows, where a Python frame can be found.
uint32_t provideFrame() {
  if (!Py_IsInitialized() || _Py_IsFinalizing() || PyGILState_GetThisThreadState() == nullptr) return 0;
  PyGILState_STATE state = PyGILState_Ensure();
  const uint32_t id = captureFrame(0);
  PyGILState_Release(state);
  return id;
}

const char* stateName(TraceState state) {
  switch (state) {
    case TraceState::SCHEDULED: return "scheduled";
    case TraceState::STARTED: return "started";
    case TraceState::COMPLETED: return "completed";
    case TraceState::FAILED: return "failed";
  }
  return "?";
}

py::dict entryDict(const TraceEntry& entry) {
  TraceEntry e = entry;
  OpHeader& h = e.header;
  // Dims past those the record keeps: shown as "..." (describe() would print zeros).
  if (e.truncatedDims) h.ndim = static_cast<uint8_t>(std::min<int>(h.ndim, 6));
  auto truncate = [&](std::string text) {
    const size_t close = text.find(']');
    if (e.truncatedDims && close != std::string::npos) text.insert(close, ", ...");
    return text;
  };
  py::dict d;
  d["id"] = e.id;
  d["seq"] = h.seq;
  d["kind"] = kindName(static_cast<OpKind>(h.kind));
  d["p2p"] = e.p2p;
  d["peer"] = e.peer;
  d["tag"] = e.tag;
  const bool hasTensor = h.ndim > 0 || h.count > 0;
  d["dtype"] = hasTensor ? py::object(py::str(dtypeName(static_cast<DType>(h.dtype)))) : py::object(py::none());
  py::list shape;
  for (int i = 0; i < h.ndim; ++i) shape.append(h.dims[i]);
  if (e.truncatedDims) shape.append(py::none());
  d["shape"] = shape;
  d["count"] = h.count;
  d["what"] = truncate(h.what());
  d["describe"] = truncate(h.describe());
  d["op"] = h.op;
  d["root"] = h.root;
  d["state"] = stateName(e.state);
  d["enqueued_ns"] = e.enqueuedNs;
  d["started_ns"] = e.startedNs;
  d["finished_ns"] = e.finishedNs;
  d["frame"] = e.frame;
  return d;
}

// An entry for a status line: what it is, its group, where it was issued, how old it is.
py::dict progressEntry(const TraceEntry& e, const std::string& group, int64_t nowNs) {
  py::dict d = entryDict(e);
  d["group"] = group;
  if (e.frame != 0) {
    const TraceFrame f = FlightRecorder::frame(e.frame);
    d["line"] = py::make_tuple(f.file, f.line, f.function);
  } else {
    d["line"] = py::none();
  }
  d["age_s"] = double(nowNs - e.enqueuedNs) * 1e-9;
  d["ago_s"] = e.finishedNs ? py::object(py::float_(double(nowNs - e.finishedNs) * 1e-9)) : py::object(py::none());
  return d;
}

}  // namespace

void noteCaller(const Communicator& comm, int depth) {
  if (gFramesOn.load(std::memory_order_relaxed) && comm.recorder()->enabled()) {
    FlightRecorder::setCallerFrame(captureFrame(depth));
  }
}

void bindTrace(py::module_& m) {
  m.def(
      "trace_snapshot",
      [] {
        py::list groups;
        std::vector<uint32_t> used;
        for (const auto& recorder : FlightRecorder::all()) {
          std::vector<TraceEntry> entries;
          {
            py::gil_scoped_release release;
            entries = recorder->snapshot();
          }
          py::list list;
          for (const auto& e : entries) {
            list.append(entryDict(e));
            if (e.frame != 0) used.push_back(e.frame);
          }
          py::dict group;
          group["name"] = recorder->name();
          group["desc"] = recorder->desc();
          group["ranks"] = recorder->ranks();
          group["capacity"] = recorder->capacity();
          group["failure"] = recorder->failure();
          const WaitTotals waits = recorder->waits();
          group["waited"] = waits.byRank;
          group["own_link_s"] = waits.ownLink;
          group["entries"] = list;
          groups.append(group);
        }
        py::dict frames;
        for (uint32_t id : used) {
          if (frames.contains(py::int_(id))) continue;
          const TraceFrame f = FlightRecorder::frame(id);
          frames[py::int_(id)] = py::make_tuple(f.file, f.line, f.function);
        }
        return py::make_tuple(groups, frames, FlightRecorder::nowNs());
      },
      "([{name, desc, ranks, capacity, failure, entries}], {frame id: (file, line, function)}, steady now ns)");
  m.def(
      "trace_progress",
      [] {
        static auto* meter = new ProgressMeter();  // one per process, never destroyed
        ProgressReport r;
        {
          py::gil_scoped_release release;
          r = meter->measure();
        }
        py::dict d;
        d["ops"] = r.ops;
        d["in_flight_s"] = double(r.inFlightNs) * 1e-9;
        d["current"] = r.hasCurrent ? py::object(progressEntry(r.current, r.currentGroup, r.nowNs)) : py::object(py::none());
        d["last"] = r.hasLast ? py::object(progressEntry(r.last, r.lastGroup, r.nowNs)) : py::object(py::none());
        py::dict waited;
        for (const auto& [rank, seconds] : r.waited) waited[py::int_(rank)] = seconds;
        d["waited_s"] = waited;
        d["own_link_s"] = r.ownLinkSeconds;
        return d;
      },
      "{ops, in_flight_s, current, last, waited_s, own_link_s}: this rank's communication so far "
      "(engine/progress_meter.h)");
  m.def(
      "set_trace_skip_prefixes",
      [](std::vector<std::string> prefixes) {
        cache().skipPrefixes = std::move(prefixes);
        FlightRecorder::setFrameProvider(&provideFrame);
        gFramesOn = true;
      },
      py::arg("prefixes"), "file prefixes whose frames are passed over (and turns frame capture on)");
  m.def("capture_frame", [] { return captureFrame(0); }, "the caller's frame id (0: none), as operations record it");
  m.def("trace_failures", &FlightRecorder::failures, "failures announced to the recorder so far");
  m.def("take_trace_signals", &FlightRecorder::takeSignals, py::arg("grace_sec"),
        "SIGUSR1 and SIGTERM (where still at their default) write to the notify fd; the signals taken");
  m.def("release_trace_signals", &FlightRecorder::releaseSignals, "gives SIGUSR1 and SIGTERM back");
  m.def("trace_signal_dumped", &FlightRecorder::signalDumped, "the SIGTERM dump is written: end now");
  m.def("set_trace_notify_fd", &FlightRecorder::setNotifyFd, py::arg("fd"),
        "a non-blocking fd that gets one byte when a communicator fails (-1: none)");
}

}  // namespace torchring
