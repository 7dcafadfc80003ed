// replica's conventions on nlohmann-json: measured numbers with 6 significant digits and null
// for NaN/inf, lines that survive text that is not UTF-8, and flat objects read back with errors
// that name the source and the byte.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/errors.h"
#include "core/json.h"

using namespace replica;

TEST(Json, NumbersKeepSixDigitsAndNonFiniteIsNull) {
  EXPECT_EQ(json_line({{"loss", json_number(2.302585092994046)}}), R"({"loss":2.30259})");
  EXPECT_EQ(json_line({{"x", json_number(std::nan(""))}, {"y", json_number(-INFINITY)}}), R"({"x":null,"y":null})");
  EXPECT_EQ(json_line({{"a", json_numbers({1.0, 0.125, 1e-9})}}), R"({"a":[1.0,0.125,1e-09]})");
  EXPECT_EQ(json_line({{"n", int64_t{1} << 40}}), R"({"n":1099511627776})") << "integers stay exact";
}

TEST(Json, KeysKeepTheirOrderAndTextIsEscaped) {
  const std::string line = json_line({{"z", 1}, {"a", "tab\there \"q\" \\ \x01"}});
  EXPECT_EQ(line, R"({"z":1,"a":"tab\there \"q\" \\ \u0001"})");
  EXPECT_EQ(parse_json_object(line, "l").text("a"), "tab\there \"q\" \\ \x01");
}

TEST(Json, TextThatIsNotUtf8IsReplacedNotLost) {
  const std::string bad = std::string("dev") + char(0xff);
  const std::string line = json_line({{"kind", "event"}, {"devices", bad}});
  const JsonObject o = parse_json_object(line, "l");
  EXPECT_EQ(o.text("kind"), "event");
  EXPECT_EQ(o.text("devices"), "dev\xEF\xBF\xBD") << "U+FFFD in place of the bad byte";
}

TEST(Json, FlatObjectsReadBack) {
  const JsonObject o = parse_json_object(R"({"kind":"step","step":3,"ok":true,"no":false,"loss":null,"a":[1,2.5,null]})", "l");
  EXPECT_EQ(o.text("kind"), "step");
  EXPECT_EQ(o.number("step"), 3);
  EXPECT_EQ(o.number("ok"), 1);
  EXPECT_EQ(o.number("no"), 0);
  EXPECT_TRUE(std::isnan(o.number("loss")));
  ASSERT_EQ(o.numbers("a").size(), 3u);
  EXPECT_EQ(o.numbers("a")[1], 2.5);
  EXPECT_TRUE(std::isnan(o.numbers("a")[2]));
  EXPECT_TRUE(std::isnan(o.number("missing")));
  EXPECT_EQ(o.text("missing"), "");
}

TEST(Json, WhatIsNotSuchAnObjectIsNamed) {
  auto fails = [](const std::string& text, const char* needle) {
    try {
      parse_json_object(text, "run/metrics.jsonl:7");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const IoError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("run/metrics.jsonl:7"), std::string::npos) << m;
      EXPECT_NE(m.find(needle), std::string::npos) << m;
    }
  };
  fails(R"({"kind":"step","loss":)", "unexpected end of input");  // a line cut by a crash
  fails("[1,2]", "a JSON array");
  fails(R"({"a":{"b":1}})", "'a' holds object");
  fails(R"({"a":["x"]})", "'a' holds string");
  fails(R"({"a":1} {"b":2})", "byte");
}
