#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

// testlib protocol without testlib: exit 0 accepted, 1 wrong answer, 2 presentation error, 3 fail.
enum { OK = 0, WA = 1, PE = 2, FAIL = 3 };

static int verdict(int code, const std::string& why) {
  std::cerr << why << "\n";
  return code;
}

static std::vector<std::string> tokens(const char* path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  std::string t;
  while (in >> t) out.push_back(t);
  return out;
}

// An optional minus and 1 to 18 digits, nothing else (so the value fits in a long long).
static bool parse_int(const std::string& s, long long& v) {
  size_t i = !s.empty() && s[0] == '-' ? 1 : 0;
  if (s.size() == i || s.size() - i > 18) return false;
  for (size_t j = i; j < s.size(); ++j)
    if (!std::isdigit(static_cast<unsigned char>(s[j]))) return false;
  v = std::stoll(s);
  return true;
}

// Every token an integer, else the output is malformed (a presentation error).
inline bool parse_ints(const std::vector<std::string>& t, std::vector<long long>& v, std::string& bad) {
  v.assign(t.size(), 0);
  for (size_t i = 0; i < t.size(); ++i)
    if (!parse_int(t[i], v[i])) {
      bad = t[i].size() > 20 ? t[i].substr(0, 20) + "..." : t[i];
      return false;
    }
  return true;
}

inline std::string clip(const std::string& s) { return s.size() > 20 ? s.substr(0, 20) + "..." : s; }

// Every value must be within 1e-6 of the jury's, absolutely or relatively.
int main(int argc, char** argv) {
  if (argc < 4) return verdict(FAIL, "usage: checker input output answer");
  std::vector<std::string> got = tokens(argv[2]), want = tokens(argv[3]);
  if (want.empty()) return verdict(FAIL, "empty answer file");
  std::vector<double> values;
  for (size_t i = 0; i < got.size(); ++i) {
    char* end = nullptr;
    values.push_back(std::strtod(got[i].c_str(), &end));
    if (end == got[i].c_str() || *end != '\0' || !std::isfinite(values.back()))
      return verdict(PE, "value " + std::to_string(i + 1) + " is not a number: " + clip(got[i]));
  }
  if (got.size() != want.size())
    return verdict(WA, "expected " + std::to_string(want.size()) + " numbers, got " +
                           std::to_string(got.size()));
  for (size_t i = 0; i < want.size(); ++i) {
    char* end = nullptr;
    double w = std::strtod(want[i].c_str(), &end);
    if (end == want[i].c_str() || *end != '\0') return verdict(FAIL, "bad answer file");
    double err = std::fabs(values[i] - w);
    if (err > 1e-6 && err > 1e-6 * std::fabs(w))
      return verdict(WA, "value " + std::to_string(i + 1) + ": expected " + want[i] + ", got " +
                             clip(got[i]));
  }
  return OK;
}
