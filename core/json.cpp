// replica's conventions on nlohmann-json: 6-digit numbers, lossless lines, flat objects read back.
#include "core/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "core/errors.h"

namespace replica {

Json json_number(double v) {
  if (!std::isfinite(v)) return nullptr;
  char b[32];
  std::snprintf(b, sizeof b, "%.6g", v);
  return std::strtod(b, nullptr);
}

Json json_numbers(const std::vector<double>& v) {
  Json a = Json::array();
  for (double x : v) a.push_back(json_number(x));
  return a;
}

std::string json_line(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

double JsonObject::number(const std::string& k) const {
  const auto it = numbers_.find(k);
  return it == numbers_.end() ? std::nan("") : it->second;
}
std::string JsonObject::text(const std::string& k) const {
  const auto it = texts_.find(k);
  return it == texts_.end() ? std::string() : it->second;
}
std::vector<double> JsonObject::numbers(const std::string& k) const {
  const auto it = arrays_.find(k);
  return it == arrays_.end() ? std::vector<double>() : it->second;
}

namespace {
const char* kNotOurs = " (not a JSON object as replica writes it)";
double scalar(const Json& v, const std::string& key, const std::string& source) {
  if (v.is_null()) return std::nan("");
  if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
  if (v.is_number()) return v.get<double>();
  throw IoError(source + ": '" + key + "' holds " + v.type_name() + kNotOurs);
}
}  // namespace

JsonObject parse_json_object(std::string_view text, const std::string& source) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::parse_error& e) {
    throw IoError(source + ": byte " + std::to_string(e.byte) + ": " + e.what() + kNotOurs);
  } catch (const Json::exception& e) {  // e.g. a number too large for a double
    throw IoError(source + ": " + e.what() + kNotOurs);
  }
  if (!j.is_object()) throw IoError(source + ": a JSON " + std::string(j.type_name()) + kNotOurs);
  JsonObject o;
  for (const auto& [k, v] : j.items()) {
    if (v.is_string()) {
      o.texts_[k] = v.get<std::string>();
    } else if (v.is_array()) {
      std::vector<double> a;
      for (const auto& x : v) a.push_back(scalar(x, k, source));
      o.arrays_[k] = std::move(a);
    } else {
      o.numbers_[k] = scalar(v, k, source);
    }
  }
  return o;
}

}  // namespace replica
