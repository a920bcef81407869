// Agreement across ranks on text: the ranks' error messages (agree_on_failure, run_agreed) and any small
// per-rank report (checkpoint checksums), over the ordinary collectives.
#include <algorithm>
#include <cstring>

#include <ruda/collectives.h>
#include <ruda/memory.h>

namespace ruda {

std::vector<std::string> all_gather_text(Communicator& comm, const std::string& text, const std::string& tag) {
  const memory::LimitSuspended bookkeeping;  // (collectives.h: exempt from the limit)
  const int world = comm.world_size();
  Tensor length = empty({1}, DType::i64);
  *static_cast<std::int64_t*>(length.data_ptr()) = static_cast<std::int64_t>(text.size());
  const Tensor lengths = comm.all_gather(length, {.tag = tag + " (lengths)"});
  const auto* sizes = static_cast<const std::int64_t*>(lengths.data_ptr());
  const std::int64_t longest = *std::max_element(sizes, sizes + world);
  // Bytes travel packed in i64 words (all_gather moves numeric dtypes only), padded to the longest.
  const std::int64_t words = (longest + 7) / 8;
  std::vector<std::string> out(static_cast<std::size_t>(world));
  if (words == 0) return out;
  Tensor mine = zeros({words}, DType::i64);
  std::memcpy(mine.data_ptr(), text.data(), text.size());
  const Tensor all = comm.all_gather(mine, {.tag = tag});
  const auto* bytes = static_cast<const char*>(all.data_ptr());
  for (int r = 0; r < world; ++r) {
    out[static_cast<std::size_t>(r)].assign(bytes + r * words * 8, static_cast<std::size_t>(sizes[r]));
  }
  return out;
}

std::vector<double> agree_on_max(Communicator& comm, const std::vector<double>& values, const std::string& tag) {
  const memory::LimitSuspended bookkeeping;  // (collectives.h: exempt from the limit)
  const Tensor mine = from_values(values, {static_cast<std::int64_t>(values.size())}, DType::f64);
  return comm.all_reduce(mine, Reduction::max, {.tag = tag}).to_vector<double>();
}

std::vector<RankFailure> agree_on_failure(Communicator& comm, const std::string& error, const std::string& tag) {
  std::vector<RankFailure> failures;
  const auto errors = all_gather_text(comm, error, tag);
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) failures.push_back({static_cast<int>(r), errors[r]});
  }
  return failures;
}

std::vector<RankFailure> run_agreed(Communicator& comm, const std::string& tag, const std::function<void()>& phase) {
  std::string error;
  if (!phase) {
    error = "run_agreed: " + tag + ": the phase function is empty";
  } else {
    try {
      phase();
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "an exception without a message";  // still a failure, not a success
    } catch (...) {  // (`throw 42`): nothing escapes, or the other ranks would wait for this one
      error = "an exception that is not a std::exception";
    }
  }
  return agree_on_failure(comm, error, tag);
}

std::string describe(const std::vector<RankFailure>& failures) {
  std::string out;
  std::vector<bool> done(failures.size(), false);
  for (std::size_t i = 0; i < failures.size(); ++i) {
    if (done[i]) continue;
    std::vector<int> ranks;
    for (std::size_t j = i; j < failures.size(); ++j) {
      if (!done[j] && failures[j].message == failures[i].message) {
        ranks.push_back(failures[j].rank);
        done[j] = true;
      }
    }
    if (!out.empty()) out += "; ";
    out += ranks.size() == 1 ? "rank " : "ranks ";
    for (std::size_t k = 0; k < ranks.size(); ++k) out += (k ? ", " : "") + std::to_string(ranks[k]);
    out += ": " + failures[i].message;
  }
  return out;
}

}  // namespace ruda
