// examples/kubernetes/replica-mpijob.yaml, checked offline (it was not run on a cluster): an
// MPIJob v2beta1 whose launcher wraps mpirun in examples/elastic/resume-loop.sh, restarts on
// failure, keeps its run directory on a mounted volume, and launches as many ranks as the workers
// have slots. These are the fields the MPI operator's CRD constrains and the ones the recipe
// depends on; a full schema validation needs the CRD (kubeconform with it, on a machine that has it).
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>

namespace {
const std::string kSource = REPLICA_SOURCE_DIR;

// Every volumeMount of a pod template names one of its volumes; returns the mounted paths.
std::set<std::string> mounts_of(const YAML::Node& pod, const std::string& who) {
  std::set<std::string> volumes, paths;
  for (const auto& v : pod["spec"]["volumes"]) volumes.insert(v["name"].as<std::string>());
  for (const auto& c : pod["spec"]["containers"]) {
    EXPECT_FALSE(c["name"].as<std::string>("").empty()) << who << ": a container without a name";
    EXPECT_FALSE(c["image"].as<std::string>("").empty()) << who << ": a container without an image";
    for (const auto& m : c["volumeMounts"]) {
      EXPECT_TRUE(volumes.count(m["name"].as<std::string>())) << who << ": mounts unknown volume " << m["name"];
      paths.insert(m["mountPath"].as<std::string>());
    }
  }
  return paths;
}
}  // namespace

TEST(Manifests, TheMpiJobIsWellFormedAndWrapsTheResumeLoop) {
  const YAML::Node job = YAML::LoadFile(kSource + "/examples/kubernetes/replica-mpijob.yaml");
  EXPECT_EQ(job["apiVersion"].as<std::string>(), "kubeflow.org/v2beta1");
  EXPECT_EQ(job["kind"].as<std::string>(), "MPIJob");
  EXPECT_TRUE(std::regex_match(job["metadata"]["name"].as<std::string>(), std::regex("[a-z0-9]([-a-z0-9]*[a-z0-9])?")))
      << "metadata.name must be a DNS-1123 label";
  const YAML::Node specs = job["spec"]["mpiReplicaSpecs"];
  ASSERT_TRUE(specs["Launcher"] && specs["Worker"]);
  const std::set<std::string> policies = {"Always", "OnFailure", "Never", "ExitCode"};
  for (const char* role : {"Launcher", "Worker"}) {
    const std::string p = specs[role]["restartPolicy"].as<std::string>("Never");
    EXPECT_TRUE(policies.count(p)) << role << ": restartPolicy " << p;
    EXPECT_NE(p, "Never") << role << ": a lost pod must be replaced";
    ASSERT_TRUE(specs[role]["template"]["spec"]["containers"].IsSequence()) << role;
  }
  EXPECT_EQ(specs["Launcher"]["replicas"].as<int>(1), 1);
  const YAML::Node launcher = specs["Launcher"]["template"];
  const auto mounted = mounts_of(launcher, "Launcher");
  mounts_of(specs["Worker"]["template"], "Worker");
  const YAML::Node c = launcher["spec"]["containers"][0];
  const std::string loop = c["command"][0].as<std::string>();
  EXPECT_NE(loop.find("examples/elastic/resume-loop.sh"), std::string::npos) << loop;
  EXPECT_TRUE(std::filesystem::exists(kSource + "/examples/elastic/resume-loop.sh"));
  const std::string run_dir = c["command"][1].as<std::string>();
  bool on_volume = false;
  for (const auto& m : mounted) on_volume |= run_dir.rfind(m, 0) == 0;
  EXPECT_TRUE(on_volume) << "the run directory " << run_dir << " must be on a mounted volume (checkpoints outlive pods)";
  std::vector<std::string> args;
  for (const auto& a : c["args"]) args.push_back(a.as<std::string>());
  auto after = [&](const std::string& flag) {
    for (size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == flag) return args[i + 1];
    return std::string();
  };
  EXPECT_EQ(args.front(), "mpirun");
  EXPECT_EQ(after("--run-dir"), run_dir) << "replica writes where the loop looks for checkpoints";
  EXPECT_EQ(std::stoi(after("-np")), job["spec"]["slotsPerWorker"].as<int>() * specs["Worker"]["replicas"].as<int>())
      << "one rank per slot";
  EXPECT_TRUE(std::find(args.begin(), args.end(), "train") != args.end());
}

TEST(Manifests, TheSlurmScriptRequeuesAndResumes) {
  std::ifstream in(kSource + "/examples/slurm/replica.sbatch");
  const std::string s((std::istreambuf_iterator<char>(in)), {});
  for (const char* must : {"#SBATCH --requeue", "--kill-on-bad-exit=1", "scontrol requeue", "--resume", "SLURM_RESTART_COUNT"})
    EXPECT_NE(s.find(must), std::string::npos) << "examples/slurm/replica.sbatch lacks " << must;
}
