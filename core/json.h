// JsonWriter: builds one JSON object or array as text with proper escaping and number handling
// (non-finite numbers become null, as JSON has no NaN). The metrics sink and the reports write
// through it instead of concatenating strings. parse_json_object reads such a line back (a flat
// object of numbers, strings, booleans, nulls and arrays of numbers: what the writer makes).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace replica {

class JsonWriter {
 public:
  JsonWriter& begin_object() { return open('{'); }
  JsonWriter& end_object() { return close('}'); }
  JsonWriter& begin_array() { return open('['); }
  JsonWriter& end_array() { return close(']'); }
  JsonWriter& key(std::string_view k) {
    comma();
    string(k);
    out_ += ':';
    after_key_ = true;
    return *this;
  }
  JsonWriter& value(std::string_view s) {
    comma();
    string(s);
    return *this;
  }
  JsonWriter& value(const char* s) { return value(std::string_view(s)); }
  JsonWriter& value(bool b) {
    comma();
    out_ += b ? "true" : "false";
    return *this;
  }
  JsonWriter& value(int64_t v) {
    comma();
    out_ += std::to_string(v);
    return *this;
  }
  JsonWriter& value(int v) { return value(static_cast<int64_t>(v)); }
  JsonWriter& value(double v) {
    comma();
    if (!std::isfinite(v)) {
      out_ += "null";
    } else {
      char b[32];
      std::snprintf(b, sizeof b, "%.6g", v);
      out_ += b;
    }
    return *this;
  }
  JsonWriter& value(float v) { return value(static_cast<double>(v)); }
  template <class T>
  JsonWriter& field(std::string_view k, const T& v) {
    key(k);
    return value(v);
  }
  JsonWriter& field(std::string_view k, const std::vector<double>& v) {
    key(k);
    begin_array();
    for (double x : v) value(x);
    return end_array();
  }
  const std::string& str() const { return out_; }

 private:
  JsonWriter& open(char c) {
    comma();
    out_ += c;
    first_.push_back(true);
    return *this;
  }
  JsonWriter& close(char c) {
    out_ += c;
    first_.pop_back();
    return *this;
  }
  void comma() {
    if (after_key_) {
      after_key_ = false;
      return;
    }
    if (!first_.empty()) {
      if (!first_.back()) out_ += ',';
      first_.back() = false;
    }
  }
  void string(std::string_view s) {
    out_ += '"';
    for (char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      switch (c) {
        case '"': out_ += "\\\""; break;
        case '\\': out_ += "\\\\"; break;
        case '\n': out_ += "\\n"; break;
        case '\r': out_ += "\\r"; break;
        case '\t': out_ += "\\t"; break;
        default:
          if (c < 0x20) {
            char b[8];
            std::snprintf(b, sizeof b, "\\u%04x", c);
            out_ += b;
          } else {
            out_ += ch;
          }
      }
    }
    out_ += '"';
  }
  std::string out_;
  std::vector<bool> first_;
  bool after_key_ = false;
};

// One flat JSON object, read back. Missing keys read as NaN / "" / empty.
struct JsonObject {
  std::map<std::string, double> numbers_;  // numbers and booleans (1/0); null is NaN
  std::map<std::string, std::string> texts_;
  std::map<std::string, std::vector<double>> arrays_;
  double number(const std::string& k) const;
  std::string text(const std::string& k) const;
  std::vector<double> numbers(const std::string& k) const;
};
// Throws IoError naming `source` and the byte where the text stops being such an object.
JsonObject parse_json_object(std::string_view text, const std::string& source);

}  // namespace replica
