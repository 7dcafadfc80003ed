// JSON through nlohmann-json (Debian's nlohmann-json3-dev): every JSON replica reads or writes
// (metrics.jsonl lines, run summaries, Chrome traces, safetensors headers) goes through it. Two
// conventions of ours sit on top: json_number() writes a measured value with 6 significant
// digits (what a plot or a report needs; metrics lines keep the size and text they had) and null
// when it is not finite (JSON has no NaN); JsonObject reads back a flat object as those lines hold.
#pragma once
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace replica {

// Keys in the order they were written (a metrics line reads the way the code lists it).
using Json = nlohmann::ordered_json;

// A measured number as metrics lines carry it: 6 significant digits, null when not finite.
Json json_number(double v);
// An array of such numbers.
Json json_numbers(const std::vector<double>& v);
// One line of text (no newline); text that is not UTF-8 is written with U+FFFD in its place
// rather than refused, so a metrics line is never lost to an odd device or file name.
std::string json_line(const Json& j);

// One flat JSON object, read back. Missing keys read as NaN / "" / empty.
struct JsonObject {
  std::map<std::string, double> numbers_;  // numbers and booleans (1/0); null is NaN
  std::map<std::string, std::string> texts_;
  std::map<std::string, std::vector<double>> arrays_;
  double number(const std::string& k) const;
  std::string text(const std::string& k) const;
  std::vector<double> numbers(const std::string& k) const;
};
// Throws IoError naming `source` and the byte where the text stops being such an object (not
// JSON; not an object; a value that is an object, or an array of anything but numbers).
JsonObject parse_json_object(std::string_view text, const std::string& source);

}  // namespace replica
