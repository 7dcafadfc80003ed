// What a collective costs on a link, for `replica plan`: the alpha-beta (Hockney) model, in which
// one message of n bytes over one hop takes alpha + n / bandwidth, a small table of links (each
// number's source beside it in link_model.cpp), a fit of a link to `replica bench allreduce`
// output, and the all-reduce algorithms NCCL chooses between (ring, tree; hierarchical across
// nodes). A model, not a simulator: no congestion, no protocol switches, no in-network reduction.
#pragma once
#include <string>
#include <vector>

namespace replica::parallel {

struct Link {
  std::string name;
  double alpha_s = 0;    // latency of one hop (launch and wire), seconds
  double bandwidth = 0;  // bytes per second, one direction, per device (per node across nodes)
  std::string about;     // what it is and where the numbers come from
};

// The kinds `--link` accepts: pcie3/4/5, nvlink1..4, ib-edr/hdr/ndr, eth10/25/50/100/400.
const std::vector<Link>& link_table();
// The table's entry; a ConfigError listing the known kinds otherwise (and, for host / mpi /
// shm, saying to measure them with `replica bench allreduce` and pass --link-file).
Link find_link(const std::string& kind);

// A link fitted to `replica bench allreduce` output (its table rows: size, count, time(us), ...;
// the rank count from its header line): least squares on the ring all-reduce's time, each row
// weighted by its own time (so 8 B and 128 MB rows count alike), rows more than 3x off the first
// fit dropped once (a noisy machine's stalls). Named host, mpi or nccl after the communicator the
// header names ("fitted" otherwise). `source` names the text in errors.
Link fit_link(const std::string& bench_output, const std::string& source);

struct Collective {
  double seconds = 0;
  std::string algorithm;  // ring, tree, or hierarchical(ring|tree)
};
// Ring all-reduce of `bytes` over `ranks`: 2(p-1) steps of bytes/p each (reduce-scatter then
// all-gather): 2(p-1) alpha + 2 (p-1)/p bytes / bandwidth.
Collective ring_all_reduce(double bytes, int ranks, const Link& l);
// NCCL's double binary tree, pipelined: 2 ceil(log2 p) alpha + 2 bytes / bandwidth (each half of
// the data goes up one tree and down it; a rank sends and receives each byte about twice).
Collective tree_all_reduce(double bytes, int ranks, const Link& l);
// `nodes` x `per_node` devices. One node: the faster of ring and tree (NCCL's tuner picks by
// size and count the same way). Across nodes: reduce-scatter inside each node (ring over
// `intra`), an all-reduce of bytes / per_node across the nodes by every local rank at once, each
// with its share of the node's `nics` x inter bandwidth (ring or tree, the faster), then an
// all-gather inside the node.
Collective all_reduce(double bytes, int nodes, int per_node, const Link& intra, const Link& inter, int nics = 1);

}  // namespace replica::parallel
