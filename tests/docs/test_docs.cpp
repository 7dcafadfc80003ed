// The repository's documentation and layering, held by tests: every relative link of the README
// and docs/ resolves (to a file, and to a heading when it names one), and the op interface names
// no backend (the run-time choice lives a floor above the implementations, ops/backend_choice.cpp).
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = REPLICA_SOURCE_DIR;

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The lines of a Markdown file outside its ``` code blocks.
std::vector<std::string> prose_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  bool code = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("```", 0) == 0) {
      code = !code;
      continue;
    }
    if (!code) out.push_back(line);
  }
  return out;
}

// GitHub's anchor of a heading: lower case, spaces to '-', everything but letters, digits, '-'
// and '_' dropped.
std::string slug(const std::string& heading) {
  std::string s;
  for (unsigned char c : heading) {
    if (std::isalnum(c) || c == '-' || c == '_') s += static_cast<char>(std::tolower(c));
    else if (c == ' ') s += '-';
  }
  return s;
}

std::set<std::string> anchors(const fs::path& md) {
  std::set<std::string> out;
  for (const std::string& line : prose_lines(read(md))) {
    size_t h = 0;
    while (h < line.size() && line[h] == '#') ++h;
    if (h > 0 && h < line.size() && line[h] == ' ') out.insert(slug(line.substr(h + 1)));
  }
  return out;
}

std::vector<fs::path> documents() {
  std::vector<fs::path> docs{kRoot / "README.md"};
  for (const auto& e : fs::directory_iterator(kRoot / "docs"))
    if (e.path().extension() == ".md") docs.push_back(e.path());
  return docs;
}

}  // namespace

TEST(Docs, EveryRelativeLinkResolves) {
  const std::regex link(R"(\]\(([^)\s]+)\))");
  int checked = 0;
  for (const fs::path& doc : documents()) {
    for (const std::string& line : prose_lines(read(doc))) {
      for (std::sregex_iterator it(line.begin(), line.end(), link), end; it != end; ++it) {
        const std::string target = (*it)[1];
        if (target.find("://") != std::string::npos || target.rfind("mailto:", 0) == 0) continue;
        const size_t hash = target.find('#');
        const std::string file = target.substr(0, hash), anchor = hash == std::string::npos ? "" : target.substr(hash + 1);
        const fs::path resolved = file.empty() ? doc : doc.parent_path() / file;
        ++checked;
        ASSERT_TRUE(fs::exists(resolved)) << doc << ": the link " << target << " names no file (" << resolved << ")";
        if (!anchor.empty()) {
          EXPECT_TRUE(anchors(resolved).count(anchor))
              << doc << ": the link " << target << " names no heading of " << resolved.filename();
        }
      }
    }
  }
  EXPECT_GT(checked, 40);  // the README and the pages link to each other: a parser that finds none is broken
}

TEST(Docs, TheReadmeIsAFrontPage) {
  int lines = 0;
  for (char c : read(kRoot / "README.md")) lines += c == '\n';
  EXPECT_LE(lines, 250) << "README.md is the front page; a topic's detail belongs on a docs/ page";
}

TEST(Layout, TheOpInterfaceNamesNoBackend) {
  const std::regex impl(R"(#include\s+"ops/(cpu/|cuda/|recording_backend))");
  for (const char* f : {"ops/backend.h", "ops/backend.cpp"}) {
    const std::string text = read(kRoot / f);
    ASSERT_FALSE(text.empty()) << f;
    EXPECT_FALSE(std::regex_search(text, impl)) << f << " includes a backend implementation; the choice of "
                                                  << "backend belongs in ops/backend_choice.cpp";
  }
  // Layers and models reach a backend only through the interface.
  for (const char* dir : {"ops/nn", "ops/models"})
    for (const auto& e : fs::directory_iterator(kRoot / dir))
      EXPECT_FALSE(std::regex_search(read(e.path()), impl)) << e.path() << " includes a backend implementation";
}
