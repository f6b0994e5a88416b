// The private side of p2p.h: the frames on a stream and each peer's Link, shared by p2p.cpp
// (posting, the progress loop, failures) and frames.cpp (what the loop does with a link).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/p2p/p2p.h"

namespace torchring {
namespace p2pwire {
inline constexpr uint32_t kFrameMagic = 0x70327074;  // "tp2p"
// DATA: a small message, payload included. A message above kEagerBytes goes in three steps
// instead: RTS (its header only), the receiver's CTS once a recv for it is posted, then
// PAYLOAD; so a large message is never buffered on the receiving side and lands directly in
// the recv's tensor. ACK answers DATA and PAYLOAD (or an RTS whose recv has another size).
inline constexpr uint32_t kData = 1, kAck = 2, kRts = 3, kCts = 4, kPayload = 5;
inline constexpr size_t kEagerBytes = 64 << 10;
}  // namespace p2pwire

struct P2P::Frame {
  uint32_t magic = p2pwire::kFrameMagic;
  uint32_t type = p2pwire::kData;
  int64_t tag = 0;
  uint64_t id = 0;     // DATA: the message's number on this stream; ACK: the message answered
  uint64_t bytes = 0;  // DATA, RTS, PAYLOAD: message bytes; ACK: the bytes the recv expected
  uint32_t ok = 1;     // ACK: 1 the recv took the message, 0 its size differed
  char what[28] = {};  // DATA: the sender's description; ACK: the receiver's
};
// Both ends read exactly this many bytes as a header.
constexpr size_t kFrameBytes = 64;

struct P2P::Pending {
  bool isSend = false;
  bool anySource = false;  // a recv posted with kAnySource; `peer` is set once it is matched
  int peer = 0;
  int64_t tag = 0;
  char* data = nullptr;
  size_t bytes = 0;
  std::string what;
  at::Tensor keep;
  std::shared_ptr<CpuWork> work;
  uint64_t id = 0;  // a send's message number
  Clock::time_point last;  // last progress, for the timeout
};

struct P2P::OutItem {
  Frame frame;
  const char* payload = nullptr;
  size_t total = 0, offset = 0;  // frame + payload bytes, and how many were written
  std::shared_ptr<Pending> send;  // null for an ACK or CTS
  at::Tensor keep;                 // a refused message's payload, until written
};

struct P2P::Stashed {
  Frame frame;
  uint64_t arrival = 0;  // P2P::arrivals_ when it arrived: a recv from any source takes the oldest
  std::vector<char> payload;
  bool complete = false;
  std::shared_ptr<Pending> waiter;  // a recv that claimed it while it was still arriving
};

struct P2P::Link {
  std::unique_ptr<OutStream> out;
  std::unique_ptr<InStream> in;
  bool shm = false;
  Clock::time_point lastActive;  // a byte moved on this link, either way
  bool hungUp = false;  // the connection this rank sent on was closed by the peer
  Clock::time_point hungUpAt;
  std::deque<OutItem> outq;
  std::map<uint64_t, std::shared_ptr<Pending>> awaitingAck;
  std::map<uint64_t, std::shared_ptr<Pending>> awaitingCts;  // large sends whose RTS went out
  std::map<uint64_t, std::shared_ptr<Pending>> cleared;      // recvs that sent CTS, by message id
  uint64_t nextId = 0;
  std::deque<std::shared_ptr<Pending>> posted;   // recvs with no message yet, oldest first
  std::deque<std::unique_ptr<Stashed>> stash;    // messages (or RTSs) with no recv yet, oldest first
  // The incoming frame being read.
  Frame frame;
  size_t frameGot = 0;
  bool inPayload = false, discarding = false;
  char* dest = nullptr;
  size_t left = 0;
  std::shared_ptr<Pending> target;  // the recv being filled, or null
  Stashed* stashTarget = nullptr;   // or the stash entry
  std::vector<char> scratch;        // where a discarded payload goes
};

}  // namespace torchring
