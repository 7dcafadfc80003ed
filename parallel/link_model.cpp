// Links, their fit to measured all-reduces, and the all-reduce algorithms' alpha-beta costs.
#include "parallel/link_model.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/errors.h"

namespace replica::parallel {

namespace {
constexpr double kGB = 1e9;
// Bandwidths are the vendor's raw unidirectional rate per device times 0.8, the share of it an
// all-reduce's bus bandwidth reaches in practice (protocol, headers, copy engines); latencies are
// per hop as NCCL's own tuning model assumes them in its order of magnitude (a few microseconds
// inside a node and over InfiniBand, tens over TCP Ethernet). Fit a real machine with
// `replica bench allreduce` and --link-file instead: these are for planning before renting.
constexpr double kEfficiency = 0.8;
Link make(const char* name, double alpha_us, double raw_gbs, const char* about) {
  return {name, alpha_us * 1e-6, raw_gbs * kGB * kEfficiency, about};
}
}  // namespace

const std::vector<Link>& link_table() {
  static const std::vector<Link> table = {
      // PCI Express: 0.985 / 1.97 / 3.94 GB/s per lane per direction for gen 3 / 4 / 5 after
      // 128b/130b encoding (PCI-SIG specifications), x16.
      make("pcie3", 8, 15.75, "PCIe 3.0 x16 (PCI-SIG: 8 GT/s per lane, 128b/130b)"),
      make("pcie4", 6, 31.5, "PCIe 4.0 x16 (PCI-SIG: 16 GT/s per lane)"),
      make("pcie5", 5, 63.0, "PCIe 5.0 x16 (PCI-SIG: 32 GT/s per lane)"),
      // NVLink per GPU, one direction: P100 4 links x 20 GB/s; V100 6 x 25; A100 12 x 25;
      // H100 18 x 25 (NVIDIA's P100, V100, A100 and H100 architecture whitepapers).
      make("nvlink1", 3, 80, "NVLink 1 (P100: 4 links x 20 GB/s per direction)"),
      make("nvlink2", 3, 150, "NVLink 2 (V100: 6 links x 25 GB/s per direction)"),
      make("nvlink3", 3, 300, "NVLink 3 (A100: 12 links x 25 GB/s per direction)"),
      make("nvlink4", 3, 450, "NVLink 4 (H100: 18 links x 25 GB/s per direction)"),
      // InfiniBand per port: EDR 100, HDR 200, NDR 400 Gb/s (InfiniBand Trade Association roadmap).
      make("ib-edr", 5, 12.5, "InfiniBand EDR, 100 Gb/s per port"),
      make("ib-hdr", 5, 25, "InfiniBand HDR, 200 Gb/s per port"),
      make("ib-ndr", 5, 50, "InfiniBand NDR, 400 Gb/s per port"),
      // Ethernet (IEEE 802.3 line rates); TCP latency, or RoCE's when the fabric has it (fit it).
      make("eth10", 30, 1.25, "10 Gb/s Ethernet, TCP"),
      make("eth25", 25, 3.125, "25 Gb/s Ethernet, TCP"),
      make("eth50", 25, 6.25, "50 Gb/s Ethernet, TCP"),
      make("eth100", 20, 12.5, "100 Gb/s Ethernet, TCP"),
      make("eth400", 20, 50, "400 Gb/s Ethernet, TCP"),
  };
  return table;
}

Link find_link(const std::string& kind) {
  for (const auto& l : link_table())
    if (l.name == kind) return l;
  std::string known;
  for (const auto& l : link_table()) known += (known.empty() ? "" : ", ") + l.name;
  if (kind == "host" || kind == "shm" || kind == "mpi")
    throw ConfigError("--link " + kind + ": CPU replicas' shared memory and MPI depend on this machine; measure it: " +
                      "replica bench allreduce --devices cpu:2 > link.txt (or under mpirun), then --link-file link.txt");
  throw ConfigError("--link '" + kind + "' is not a known link; use one of " + known +
                    ", or --link-file FILE (replica bench allreduce output, or YAML {name, alpha_us, bandwidth_gbs})");
}

Collective ring_all_reduce(double bytes, int p, const Link& l) {
  if (p <= 1) return {0, "none"};
  return {2.0 * (p - 1) * l.alpha_s + 2.0 * (p - 1) / p * bytes / l.bandwidth, "ring"};
}

Collective tree_all_reduce(double bytes, int p, const Link& l) {
  if (p <= 1) return {0, "none"};
  return {2.0 * std::ceil(std::log2(static_cast<double>(p))) * l.alpha_s + 2.0 * bytes / l.bandwidth, "tree"};
}

namespace {
Collective faster(const Collective& a, const Collective& b) { return a.seconds <= b.seconds ? a : b; }
}  // namespace

Collective all_reduce(double bytes, int nodes, int per_node, const Link& intra, const Link& inter, int nics) {
  if (nodes <= 1) return faster(ring_all_reduce(bytes, per_node, intra), tree_all_reduce(bytes, per_node, intra));
  // Reduce-scatter and all-gather inside the node: each (p-1) steps of bytes/p.
  const double inside = per_node > 1 ? 2.0 * ((per_node - 1) * intra.alpha_s +
                                              (per_node - 1.0) / per_node * bytes / intra.bandwidth)
                                     : 0.0;
  Link share = inter;
  share.bandwidth = inter.bandwidth * std::max(1, nics) / per_node;  // the node's NICs shared by its ranks
  const double part = bytes / per_node;
  const Collective across = faster(ring_all_reduce(part, nodes, share), tree_all_reduce(part, nodes, share));
  return {inside + across.seconds, "hierarchical(" + across.algorithm + ")"};
}

Link fit_link(const std::string& text, const std::string& source) {
  int ranks = 0;
  std::string name = "fitted";
  std::vector<std::pair<double, double>> rows;  // bytes, seconds
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# replica bench allreduce:", 0) == 0) {
      std::istringstream h(line.substr(26));
      h >> ranks;
      // What carried it, as bench allreduce names it: the plan treats MPI processes (pinned one
      // per core by node slot) and one process's replica threads differently.
      name = line.find("MPI between") != std::string::npos ? "mpi"
             : line.find("NCCL") != std::string::npos      ? "nccl"
             : line.find("host communicator") != std::string::npos ? "host"
                                                               : "fitted";
      continue;
    }
    if (line.empty() || line[0] == '#') continue;
    std::istringstream r(line);
    double bytes = 0, count = 0, us = 0;
    if (r >> bytes >> count >> us && bytes > 0 && us > 0) rows.push_back({bytes, us * 1e-6});
  }
  if (ranks < 2)
    throw ConfigError(source + ": no '# replica bench allreduce: N ranks' header with N >= 2; write the file with "
                      "replica bench allreduce --devices cpu:2 > FILE");
  if (rows.size() < 3)
    throw ConfigError(source + ": " + std::to_string(rows.size()) + " measured rows; the fit needs at least 3 sizes (-b 1K -e 64M)");
  // t = a + b * bytes, least squares on relative error: minimise sum ((a + b x - t) / t)^2.
  auto fit = [](const std::vector<std::pair<double, double>>& pts, double& a, double& b) {
    double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
    for (const auto& [x, t] : pts) {
      const double w = 1.0 / (t * t);
      s00 += w, s01 += w * x, s11 += w * x * x, r0 += w * t, r1 += w * x * t;
    }
    const double det = s00 * s11 - s01 * s01;
    a = (r0 * s11 - r1 * s01) / det;
    b = (s00 * r1 - s01 * r0) / det;
  };
  double a = 0, b = 0;
  fit(rows, a, b);
  std::vector<std::pair<double, double>> kept;
  for (const auto& [x, t] : rows) {
    const double model = a + b * x;
    if (model > 0 && t / model < 3 && model / t < 3) kept.push_back({x, t});
  }
  if (kept.size() >= 3 && kept.size() < rows.size()) fit(kept, a, b);
  if (b <= 0)
    throw ConfigError(source + ": the times do not grow with the size (" + std::to_string(rows.size()) +
                      " rows); measure larger sizes (-e 64M) or more iterations (-n 50)");
  const double p = ranks;
  Link l;
  l.name = name;
  l.bandwidth = 2.0 * (p - 1) / p / b;
  l.alpha_s = std::max(0.0, a) / (2.0 * (p - 1));
  char about[200];
  std::snprintf(about, sizeof about, "fitted to %s (%d ranks, %zu of %zu sizes): %.1f us per hop, %.2f GB/s",
                source.c_str(), ranks, kept.size() >= 3 ? kept.size() : rows.size(), rows.size(), l.alpha_s * 1e6,
                l.bandwidth / kGB);
  l.about = about;
  return l;
}

}  // namespace replica::parallel
