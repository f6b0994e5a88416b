// The failure board (communicator.h FailureBoard): how a failing rank tells the others why
// through the rendezvous store, and how a rank whose peer failed reads why, without ever
// waiting long on a store that may be unreachable.
#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "engine/communicator.h"

namespace torchring {

namespace {

// Runs `fn` on a detached thread and returns its result, or `fallback` when it has not
// finished within `seconds`. For the rendezvous store on failure paths: a store whose host
// is unreachable can block a request for good, and a failing rank must still raise within
// the timeout. `fn` must own everything it uses (the thread may outlive the caller).
std::string withDeadline(std::function<std::string()> fn, double seconds, std::string fallback) {
  struct Shared {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    std::string result;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, fn = std::move(fn)] {
    std::string result;
    try {
      result = fn();
    } catch (const std::exception&) {  // the store is gone too: no explanation
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->result = std::move(result);
    shared->done = true;
    shared->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->mutex);
  if (!shared->cv.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return shared->done; })) {
    return fallback;
  }
  return shared->result;
}

}  // namespace

namespace {

// The rank a failure message blames for its link, as TcpLinks words it ("... by rank 7
// (leader of host 3, ...)"), or -1.
int blamedRank(const std::string& message) {
  static const std::string tail = " (leader of host ";
  const size_t at = message.rfind(tail);
  if (at == std::string::npos) return -1;
  const size_t start = message.rfind("rank ", at);
  if (start == std::string::npos) return -1;
  try {
    return std::stoi(message.substr(start + 5, at - start - 5));
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

// Posts this rank's message first (so a peer waiting on us learns it at once), then reads why
// `peer` failed. A dead peer posts nothing: then it is the culprit. A peer's first post is its
// bare message (its own explanation follows once it has read its peer's); when that is all
// there is after a short wait, the chain is followed through the board: the rank the bare
// message blames, and the one that one blames, ..., so that a survivor several links away from
// a lost host still names it. Every store request runs under withDeadline: an unreachable
// store never holds this up. When `peer`'s connection ended, it posted before closing
// (execute() posts before it closes the links) or it died: a short patience tells which.
std::string Communicator::explainPeer(int peer, const std::string& message) {
  if (!board_.read) return "";
  const double patience = TcpLinks::connectionEnded(message) ? 0.3 : std::min(2.0, opt_.timeoutSec);
  auto board = board_;  // copies: the thread below may outlive this communicator
  const int rank = opt_.rank;
  return withDeadline(
      [board, rank, peer, message, patience] {
        board.post(rank, message);
        auto explained = [](const std::string& m) { return m.find(" -- ") != std::string::npos; };
        auto start = Clock::now();
        std::string theirs;
        double bareSince = -1;
        do {
          theirs = board.read(peer);
          if (explained(theirs)) break;
          if (!theirs.empty() && bareSince < 0) bareSince = secondsSince(start);
          if (bareSince >= 0 && secondsSince(start) - bareSince > 0.3) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        } while (secondsSince(start) < patience);
        if (theirs.empty()) return " -- rank " + std::to_string(peer) + " reported no error: it died or is unreachable";
        std::string out = " -- because rank " + std::to_string(peer) + " failed first: " + theirs;
        std::vector<int> seen{rank, peer};
        for (int hop = 0; hop < 16 && !explained(theirs); ++hop) {
          const int next = blamedRank(theirs);
          if (next < 0 || std::find(seen.begin(), seen.end(), next) != seen.end()) break;
          seen.push_back(next);
          theirs = board.read(next);
          if (theirs.empty()) return out + " -- rank " + std::to_string(next) + " reported no error: it died or is unreachable";
          out += " -- because rank " + std::to_string(next) + " failed first: " + theirs;
        }
        return out;
      },
      patience + 1.0,
      " -- " + board.where + " did not answer within " + std::to_string(static_cast<int>(patience + 1.0)) +
          " s either: that host is likely unreachable or down, so rank " + std::to_string(peer) +
          "'s own error is unknown");
}

struct Communicator::News {
  std::mutex mutex;
  std::string text;        // the newest answer ("" while none)
  bool asking = false;     // a reading thread runs
  Clock::time_point asked{};
};

// The board is asked on a detached thread (the store may not answer); the caller reads the
// last answer and at most every 0.5 s starts another question. A posted failure is final (the
// poster's communicator is dead), so once there is an answer it is kept.
std::string Communicator::boardNews() {
  if (!board_.latest) return "";
  if (!news_) news_ = std::make_shared<News>();
  auto news = news_;
  std::lock_guard<std::mutex> lock(news->mutex);
  if (!news->text.empty() || news->asking || secondsSince(news->asked) < 0.5) return news->text;
  news->asking = true;
  news->asked = Clock::now();
  std::thread([news, latest = board_.latest] {
    std::string text;
    try {
      text = latest();
    } catch (const std::exception&) {  // the store is gone: nothing learned
    }
    std::lock_guard<std::mutex> lock(news->mutex);
    news->text = std::move(text);
    news->asking = false;
  }).detach();
  return news->text;
}

// Tells the others why through the failure board, without waiting long on the store.
void Communicator::postFailure(const std::string& message) {
  if (!board_.post) return;
  auto post = board_.post;
  const int rank = opt_.rank;
  withDeadline([post, rank, message] { post(rank, message); return std::string(); }, 1.0, "");
}

}  // namespace torchring
