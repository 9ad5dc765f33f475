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

#include <map>
int main(int argc, char** argv) {
  if (argc < 4) return verdict(FAIL, "usage: checker input output answer");
  std::vector<std::string> in = tokens(argv[1]), got = tokens(argv[2]), want = tokens(argv[3]);
  long long n = 0, jury = 0, x = 0;
  if (in.empty() || !parse_int(in[0], n) || (long long)in.size() < 1 + n || want.size() != 1 ||
      !parse_int(want[0], jury))
    return verdict(FAIL, "bad input or answer file");
  std::vector<long long> values;
  std::string bad;
  if (!parse_ints(got, values, bad)) return verdict(PE, "not an integer: " + bad);
  if (values.size() != 1) return verdict(WA, "expected one value, got " + std::to_string(values.size()));
  x = values[0];
  const long long none = -1000000001;
  if (jury == none) return x == none ? OK : verdict(WA, "all values are distinct");
  if (x == none) return verdict(WA, "a repeated value exists");
  long long count = 0;
  for (long long i = 1; i <= n; ++i) {
    long long a = 0;
    if (!parse_int(in[i], a)) return verdict(FAIL, "bad input file");
    count += a == x;
  }
  return count >= 2 ? OK : verdict(WA, got[0] + " occurs " + std::to_string(count) + " time(s)");
}
