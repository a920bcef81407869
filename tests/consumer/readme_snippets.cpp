// README.md's library snippets that are not whole programs (the sharded GPT step, the hybrid
// ShardMesh), compiled as README.md shows them (run.cmake extracts each into a .inc file included
// below) with the names they assume defined around them, and run over emulated ranks.
#include <cstdint>
#include <cstdio>

#include <ruda/nn.h>

using namespace ruda;

namespace {

// README, "Sharded training": a step of the GPT sharded in groups. Assumes comm, x, y, local_tokens.
void sharded_gpt_step(Communicator& comm, const Tensor& x, const Tensor& y, double local_tokens) {
#include "readme_sharded_gpt.inc"
}

// README, "Hybrid sharding": the GPT sharded within nodes, replicated across them, then a step
// while the mesh (the snippet's local) lives. Assumes comm, model.
void hybrid_gpt_step(Communicator& comm, nn::GPT& model) {
#include "readme_shard_mesh.inc"
  const Tensor loss = nn::cross_entropy(model.forward(randint({1, 16}, 0, 256, 5)), randint({1, 16}, 0, 256, 6));
  loss.backward();
}

}  // namespace

int main() {
  run_ranks(2, [](Communicator& comm) {
    const Tensor x = randint({2, 128}, 0, 256, 1 + comm.rank()), y = randint({2, 128}, 0, 256, 3 + comm.rank());
    sharded_gpt_step(comm, x, y, static_cast<double>(y.numel()));
  });
  EmulatedOptions two_nodes;
  two_nodes.ranks_per_node = 2;
  run_ranks(
      4,
      [](Communicator& comm) {
        nn::DeferredInit deferred;
        nn::GPT model({.vocabulary = 256, .context = 16, .d_model = 32, .layers = 2, .heads = 2});
        hybrid_gpt_step(comm, model);
      },
      two_nodes);
  std::printf("README snippets ran\n");
  return 0;
}
