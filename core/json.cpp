// Reading back the flat JSON objects JsonWriter writes (metrics.jsonl lines).
#include "core/json.h"

#include <cstdlib>

#include "core/errors.h"

namespace replica {

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
struct Reader {
  std::string_view s;
  const std::string& source;
  size_t i = 0;
  [[noreturn]] void fail(const std::string& what) const {
    throw IoError(source + ": byte " + std::to_string(i) + ": " + what + " (not a JSON object as replica writes it)");
  }
  void ws() {
    while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n')) ++i;
  }
  bool take(char c) {
    ws();
    if (i < s.size() && s[i] == c) return ++i, true;
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i < s.size() && s[i] != '"') {
      char c = s[i++];
      if (c == '\\') {
        if (i >= s.size()) fail("unterminated escape");
        const char e = s[i++];
        c = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'u' ? (i += 4, '?') : e;
      }
      out += c;
    }
    if (i >= s.size()) fail("unterminated string");
    ++i;
    return out;
  }
  double number() {
    ws();
    if (s.compare(i, 4, "null") == 0) return i += 4, std::nan("");
    if (s.compare(i, 4, "true") == 0) return i += 4, 1.0;
    if (s.compare(i, 5, "false") == 0) return i += 5, 0.0;
    const std::string rest(s.substr(i, std::min<size_t>(64, s.size() - i)));
    char* end = nullptr;
    const double v = std::strtod(rest.c_str(), &end);
    if (end == rest.c_str()) fail("expected a value");
    i += static_cast<size_t>(end - rest.c_str());
    return v;
  }
};
}  // namespace

JsonObject parse_json_object(std::string_view text, const std::string& source) {
  Reader r{text, source};
  JsonObject o;
  r.expect('{');
  if (!r.take('}')) {
    do {
      const std::string k = r.string();
      r.expect(':');
      r.ws();
      if (r.i < text.size() && text[r.i] == '"') {
        o.texts_[k] = r.string();
      } else if (r.take('[')) {
        std::vector<double> v;
        if (!r.take(']')) {
          do v.push_back(r.number());
          while (r.take(','));
          r.expect(']');
        }
        o.arrays_[k] = std::move(v);
      } else {
        o.numbers_[k] = r.number();
      }
    } while (r.take(','));
    r.expect('}');
  }
  r.ws();
  if (r.i != text.size()) r.fail("text after the object");
  return o;
}

}  // namespace replica
