// The configuration reference rendered from the schema (train/config.cpp): `replica config` on a
// terminal, `replica config KEY` for one key, and docs/configuration.md (`replica config
// --markdown`; tests/apps/test_cli.cpp fails when the checked-in page differs).
#include <algorithm>
#include <sstream>

#include "core/errors.h"
#include "train/config.h"

namespace replica::train {

namespace {

std::string section_of(const std::string& key) { return key.substr(0, key.find('.')); }

std::string cell(std::string s) {  // a Markdown table cell: '|' escaped
  for (size_t i = 0; (i = s.find('|', i)) != std::string::npos; i += 2) s.replace(i, 1, "\\|");
  return s;
}

}  // namespace

std::string config_reference_text(const std::string& section) {
  const auto keys = config_reference();
  std::vector<std::string> sections;
  for (const auto& k : keys)
    if (std::find(sections.begin(), sections.end(), section_of(k.key)) == sections.end())
      sections.push_back(section_of(k.key));
  if (!section.empty() && std::find(sections.begin(), sections.end(), section) == sections.end())
    throw ConfigError("replica config: no section '" + section + "'" + did_you_mean(section, sections) +
                      " (sections: model, data, train, checkpoint, optim, parallel, memory, run)");
  size_t kw = 0, dw = 0;
  for (const auto& k : keys) kw = std::max(kw, k.key.size()), dw = std::max(dw, std::min<size_t>(k.default_value.size(), 24));
  std::ostringstream os;
  std::string last;
  for (const auto& k : keys) {
    const std::string sec = section_of(k.key);
    if (!section.empty() && sec != section) continue;
    if (sec != last) os << (last.empty() ? "" : "\n") << sec << ":\n", last = sec;
    os << "  " << k.key << std::string(kw - k.key.size() + 2, ' ') << k.default_value
       << std::string(k.default_value.size() < dw ? dw - k.default_value.size() + 2 : 2, ' ') << k.doc << "\n";
  }
  os << "\nkey, default, what it does; `replica config KEY` shows one key with its values; "
        "`--set section.key=value` overrides any key.\n";
  return os.str();
}

std::string config_key_text(const std::string& key) {
  const auto keys = config_reference();
  std::vector<std::string> names;
  for (const auto& k : keys) {
    if (k.key == key) {
      std::ostringstream os;
      os << k.key << "\n  " << k.doc << "\n  values:  " << k.allowed << "\n  default: " << k.default_value << "\n";
      if (!k.more.empty()) os << "  more:    docs/" << k.more << "\n";
      return os.str();
    }
    names.push_back(k.key);
  }
  if (key.find('.') == std::string::npos) return config_reference_text(key);  // a section
  throw ConfigError("replica config: no key '" + key + "'" + did_you_mean(key, names) +
                    " (`replica config` lists every key)");
}

std::string config_reference_markdown() {
  std::ostringstream os;
  os << "# Configuration reference\n\n"
        "Every key of a run configuration, its default (what an omitted key means) and the values it takes.\n"
        "This page is what `replica config --markdown` prints, generated from the schema in `train/config.cpp`,\n"
        "where each key's description lives beside the code that reads it; a test fails when the two differ.\n"
        "On a terminal, `replica config` lists the keys and `replica config KEY` explains one.\n\n"
        "`--set section.key=value` overrides any key; lists are written as YAML: `--set data.mean=[0.5,0.5,0.5]`.\n"
        "A value outside its range, an unknown key (with the nearest known one) or a wrong type is an error\n"
        "naming the file, line and key. Back to the [front page](../README.md); all topics in the [index](README.md).\n";
  std::string last;
  for (const auto& k : config_reference()) {
    const std::string sec = section_of(k.key);
    if (sec != last) {
      os << "\n## " << sec << "\n\n| key | default | values | what it does |\n|---|---|---|---|\n";
      last = sec;
    }
    os << "| `" << k.key << "` | `" << cell(k.default_value) << "` | " << cell(k.allowed) << " | " << cell(k.doc);
    if (!k.more.empty()) os << " ([more](" << k.more << "))";
    os << " |\n";
  }
  return os.str();
}

}  // namespace replica::train
