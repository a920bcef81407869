// ShardMesh: the world as nodes (shard) x replicas (replicate), checked to tile it.
#include <algorithm>
#include <set>
#include <sstream>

#include "internal.h"

namespace ruda {

namespace {

std::string layout_text(const std::vector<std::int64_t>& all, int world) {
  // all: per world rank [shard rank, shard size, replicate rank, replicate size]
  std::ostringstream out;
  for (int r = 0; r < world; ++r) {
    const auto* v = all.data() + 4 * r;
    out << (r ? ", " : "") << "rank " << r << ": shard " << v[0] << "/" << v[1] << ", replica " << v[2] << "/" << v[3];
    if (r == 7 && world > 9) {
      out << ", ...";
      break;
    }
  }
  return out.str();
}

}  // namespace

ShardMesh ShardMesh::by_node(Communicator& world, int ranks_per_node) {
  const int n = world.world_size();
  // Every rank's count first: a rank asking for another count built a layout others did not ask
  // for, and one whose count was refused left the others waiting in split() until the timeout.
  const std::vector<std::int64_t> asked =
      world.all_gather(from_vector<std::int64_t>({ranks_per_node}, {1}), {.tag = "ShardMesh::by_node: ranks per node"})
          .to_vector<std::int64_t>();
  for (int r = 1; r < n; ++r) {
    if (asked[static_cast<std::size_t>(r)] != asked[0]) {
      fail<TopologyError>("ShardMesh::by_node", "rank ", world.rank(),
                          ": the ranks ask for different ranks per node: ", "rank 0 for ", asked[0], ", rank ", r,
                          " for ", asked[static_cast<std::size_t>(r)], " (every rank passes the same count)");
    }
  }
  if (ranks_per_node < 0 || (ranks_per_node > 0 && n % ranks_per_node != 0)) {
    fail<TopologyError>("ShardMesh::by_node", "rank ", world.rank(), ": ", ranks_per_node,
                        " ranks per node do not divide a world of ", n, " ranks into nodes of equal size",
                        ranks_per_node > 0 ? "" : " (give 0 for the communicator's own nodes, or a positive count)");
  }
  std::unique_ptr<Communicator> shard =
      ranks_per_node == 0 ? world.split_by_node() : world.split(world.rank() / ranks_per_node, world.rank());
  std::unique_ptr<Communicator> replicate = world.split(shard->rank(), world.rank());
  return ShardMesh(world, std::move(shard), std::move(replicate));
}

ShardMesh::ShardMesh(Communicator& world, std::unique_ptr<Communicator> shard, std::unique_ptr<Communicator> replicate)
    : world_(&world), world_alive_(world.liveness()), shard_(std::move(shard)), replicate_(std::move(replicate)) {
  const int n = world.world_size();
  // Every rank's place in both, on every rank: each decides the same.
  const std::vector<std::int64_t> mine = shard_ && replicate_
                                             ? std::vector<std::int64_t>{shard_->rank(), shard_->world_size(),
                                                                         replicate_->rank(), replicate_->world_size()}
                                             : std::vector<std::int64_t>{-1, 0, -1, 0};
  const std::vector<std::int64_t> all =
      world.all_gather(from_vector(mine, {4}), {.tag = "ShardMesh: the layout"}).to_vector<std::int64_t>();
  std::string error;
  std::set<std::pair<std::int64_t, std::int64_t>> places;
  const std::int64_t shard_size = all[1], replicas = all[3];
  for (int r = 0; r < n && error.empty(); ++r) {
    const auto* v = all.data() + 4 * r;
    if (v[1] <= 0 || v[3] <= 0) {
      error = "rank " + std::to_string(r) + " has no shard or no replicate communicator";
    } else if (v[1] != shard_size || v[3] != replicas) {
      error = "the shard communicators (or the replicate ones) differ in size";
    } else if (!places.insert({v[2], v[0]}).second) {
      error = "two ranks have the same place (replica " + std::to_string(v[2]) + ", shard rank " +
              std::to_string(v[0]) + ")";
    }
  }
  if (error.empty() && shard_size * replicas != n) {
    error = std::to_string(replicas) + " replicas of " + std::to_string(shard_size) + " ranks are not a world of " +
            std::to_string(n);
  }
  if (!error.empty()) {
    fail<TopologyError>("ShardMesh", "rank ", world.rank(),
                        ": the shard and replicate communicators do not tile the world of ", n, " ranks: ", error, " (",
                        layout_text(all, n), ")");
  }
  // The places are a grid; the communicators must also agree with them. Each communicator's
  // members, as world ranks (gathered over it: whatever a rank calls it, the members of one
  // communicator exchange the same list), are then compared across the world. Comparing only
  // places, gathered over the two communicators, let a rank that passed them swapped pass: its
  // gathers paired with other ranks' gathers on the other communicator, and later collectives
  // mixed the groups without an error.
  const std::int64_t me = world.rank();
  const auto members = [&](Communicator& c, const char* tag) {
    return c.all_gather(from_vector(std::vector<std::int64_t>{me}, {1}), {.tag = tag}).to_vector<std::int64_t>();
  };
  std::vector<std::int64_t> lists = members(*shard_, "ShardMesh: the members of a shard communicator");
  const std::vector<std::int64_t> across = members(*replicate_, "ShardMesh: the members of a replicate communicator");
  lists.insert(lists.end(), across.begin(), across.end());
  const std::int64_t width = shard_size + replicas;
  const std::vector<std::int64_t> every =
      world.all_gather(from_vector(lists, {width}), {.tag = "ShardMesh: the communicators' members"})
          .to_vector<std::int64_t>();
  // Rank r's shard members are every[r * width + i], i < shard_size; its replicate members follow.
  auto shard_of = [&](std::int64_t r, std::int64_t i) { return every[static_cast<std::size_t>(r * width + i)]; };
  auto replica_of = [&](std::int64_t r, std::int64_t i) {
    return every[static_cast<std::size_t>(r * width + shard_size + i)];
  };
  std::string mismatch;
  for (std::int64_t r = 0; r < n && mismatch.empty(); ++r) {
    const auto* v = all.data() + 4 * r;
    if (shard_of(r, v[0]) != r || replica_of(r, v[2]) != r) {
      mismatch = "rank " + std::to_string(r) + " is not at its own place in its communicators";
      break;
    }
    for (std::int64_t i = 0; i < shard_size && mismatch.empty(); ++i) {
      const std::int64_t m = shard_of(r, i);
      if (m < 0 || m >= n || all[static_cast<std::size_t>(4 * m + 2)] != v[2]) {
        mismatch = "the shard communicator of rank " + std::to_string(r) + " holds rank " + std::to_string(m) +
                   " of another replica";
      } else {
        for (std::int64_t j = 0; j < shard_size; ++j) {
          if (shard_of(m, j) != shard_of(r, j)) {
            mismatch = "ranks " + std::to_string(r) + " and " + std::to_string(m) +
                       " share a shard communicator but list different members (communicators passed in another "
                       "order?)";
            break;
          }
        }
      }
    }
    for (std::int64_t i = 0; i < replicas && mismatch.empty(); ++i) {
      const std::int64_t m = replica_of(r, i);
      if (m < 0 || m >= n || all[static_cast<std::size_t>(4 * m)] != v[0]) {
        mismatch = "the replicate communicator of rank " + std::to_string(r) + " holds rank " + std::to_string(m) +
                   " of another shard rank";
      }
    }
  }
  if (!mismatch.empty()) {
    fail<TopologyError>("ShardMesh", "rank ", world.rank(),
                        ": the shard and replicate communicators do not tile the world of ", n, " ranks: ", mismatch,
                        " (", layout_text(all, n), ")");
  }
}

void ShardMesh::require_communicators(const char* what) const {
  if (!shard_ || !replicate_) {
    fail<ArgumentError>(what, "this ShardMesh was moved from and holds no communicators");
  }
}
Communicator& ShardMesh::world() const {
  require_communicators("ShardMesh::world");
  if (world_alive_.expired()) {
    fail<ArgumentError>("ShardMesh::world", "the world communicator this ", describe(),
                        " mesh was made over was destroyed (it must outlive the mesh)");
  }
  return *world_;
}
Communicator& ShardMesh::shard() const {
  require_communicators("ShardMesh::shard");
  return *shard_;
}
Communicator& ShardMesh::replicate() const {
  require_communicators("ShardMesh::replicate");
  return *replicate_;
}

std::string ShardMesh::describe() const {
  return std::to_string(nodes()) + (nodes() == 1 ? " node" : " nodes") + " x " + std::to_string(ranks_per_node()) +
         (ranks_per_node() == 1 ? " rank" : " ranks");
}

}  // namespace ruda
