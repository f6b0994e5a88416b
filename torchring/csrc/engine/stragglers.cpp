// The straggler watch of a communicator: how long this rank waited for each rank so far
// (the shared-memory and TCP wait ledgers, core/waits.h), and the one warning that names a
// rank late in half of the last kLateWindow collectives. An operation's late rank is the one
// this rank waited for longest in it, when that wait reached stragglerSec; lateWindow_ keeps
// the late rank of each of the last kLateWindow operations (-1: none) and lateCount_ how
// often each rank appears there, so a rank is judged on a sliding window, and lateNamed_
// keeps the warning to once per rank.
#include <iomanip>
#include <sstream>

#include "engine/communicator.h"

namespace torchring {

std::vector<double> Communicator::waitedSeconds() const {
  std::vector<double> out(opt_.size, 0.0);
  const double secPerTick = nsPerTick() * 1e-9;
  if (shm_) {
    const auto& local = opt_.hosts[hostIndex_];
    for (size_t i = 0; i < local.size(); ++i) out[local[i]] += shm_->waits().total(static_cast<int>(i)) * secPerTick;
  }
  if (tcp_) {
    for (int m = 0; m < numHosts(); ++m) out[opt_.hosts[m][0]] += tcp_->waits().total(m) * secPerTick;
  }
  return out;
}

double Communicator::ownLinkSeconds() const { return tcp_ ? tcp_->waits().own() * nsPerTick() * 1e-9 : 0.0; }

std::string Communicator::hostText(int rank) const {
  const int host = rankHost_[rank];
  const bool named = host < static_cast<int>(opt_.hostNames.size()) && !opt_.hostNames[host].empty();
  const std::string name = "host " + (named ? opt_.hostNames[host] : std::to_string(host));
  return host == hostIndex_ ? name + ", this host" : name;
}

void Communicator::noteWaits(const OpHeader& header) {
  int late = -1;
  int64_t longest = 0;
  if (shm_) {
    auto [peer, ticks] = shm_->waits().opLongest();
    if (peer >= 0) late = opt_.hosts[hostIndex_][peer], longest = ticks;
  }
  if (tcp_) {
    auto [member, ticks] = tcp_->waits().opLongest();
    if (member >= 0 && ticks > longest) late = opt_.hosts[member][0], longest = ticks;
  }
  // nsPerTick() reads the steady clock, a fiftieth of a 4-byte allreduce here: once it has
  // settled, every 4096th operation reads it.
  if (--opsToCalibrate_ <= 0) {
    bool settled = false;
    secPerTick_ = nsPerTick(&settled) * 1e-9;
    opsToCalibrate_ = settled ? 4096 : 1;
  }
  const double seconds = longest * secPerTick_;
  if (opt_.stragglerSec <= 0 || seconds < opt_.stragglerSec) late = -1;
  const int gone = lateWindow_[lateNext_];
  if (gone >= 0) --lateCount_[gone];
  lateWindow_[lateNext_] = late;
  lateNext_ = (lateNext_ + 1) % kLateWindow;
  if (late < 0 || ++lateCount_[late] < kLateWindow / 2 || lateNamed_[late]) return;
  lateNamed_[late] = true;
  const std::vector<double> waited = waitedSeconds();
  std::ostringstream msg;
  msg << std::fixed << std::setprecision(1) << opt_.label << rankText() << ": rank " << late << " (" << hostText(late) << ") made this rank wait "
      << opt_.stragglerSec * 1000 << " ms or more in " << lateCount_[late] << " of the last " << kLateWindow
      << " collectives (" << seconds * 1000 << " ms in " << header.what() << "; " << std::setprecision(2)
      << waited[late] << " s in all so far): it is persistently late. Look at what it does between collectives (data loading, "
         "compute, a slower host or link); torchring.stats() gives every rank's waits, and python -m "
         "torchring.trace names where each rank is (TORCHRING_STRAGGLER_MS sets the threshold, 0 turns this off)";
  warn(msg.str());
}

}  // namespace torchring
