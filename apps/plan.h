// `replica plan`: predicts step time, images/s, scaling efficiency, exposed communication,
// memory, time and cost of a configuration on N devices (train/scaling_plan.h) before renting.
#pragma once
#include <string>
#include <vector>

namespace replica::apps {

struct PlanArgs {
  std::string config;
  std::vector<std::string> sets;
  std::string devices = "1,2,4,8";  // N or NODESxPER_NODE, comma-separated alternatives
  std::vector<std::string> links;   // intra-node link kinds, one alternative each
  std::string inter_link;           // across nodes (needed when a target has several nodes)
  int nics = 1;
  std::string link_file;            // replaces --link: bench allreduce output or YAML
  std::string device_profile;       // a saved profile instead of measuring here
  std::string trace_profile;        // a `replica train --trace` file of a run of this configuration
  std::string save_profile;
  bool profile = false;             // measure here (the default without --device-profile)
  int profile_steps = 5;
  double device_images_per_s = 0;   // rescale the profile to this rate per device (0: as measured)
  int cores = 0;                    // CPU replicas: the node's cores (0: this machine's)
  double data_images_per_s = 0;
  double epochs = -1;               // -1: train.epochs
  double cost_per_device_hour = -1; // -1: run.cost_per_device_hour
  bool memory = true;               // memplan per alternative
  bool json = false;
};
int run_plan(const PlanArgs& a);

}  // namespace replica::apps
