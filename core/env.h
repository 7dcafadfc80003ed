// Boolean switches from the environment (REPLICA_ALLOW_TF32=1, REPLICA_PREALLOCATE=false, ...),
// parsed one way everywhere: a misspelt value is an error naming the variable, not silently off.
#pragma once
#include <optional>
#include <string>

namespace replica {

// true/1/yes/on or false/0/no/off (any case); nullopt for anything else.
std::optional<bool> parse_bool_text(const std::string& text);
// Unset or empty: false. Otherwise parse_bool_text, or ConfigError naming the variable and value.
bool env_flag(const char* name);
// The same, but unset or empty gives `fallback` (a switch that is on unless turned off).
bool env_flag(const char* name, bool fallback);

}  // namespace replica
