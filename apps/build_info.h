// What this build of replica is: its version, the git commit it was built from, and what it
// was built with (`replica --version`).
#pragma once
#include <string>

namespace replica::apps {

std::string version_report();

}  // namespace replica::apps
