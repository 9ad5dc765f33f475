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

int main(int argc, char** argv) {
  if (argc < 4) return verdict(FAIL, "usage: checker input output answer");
  std::vector<std::string> in = tokens(argv[1]), got = tokens(argv[2]), want = tokens(argv[3]);
  long long n = 0, m = 0;
  if (in.size() < 2 || !parse_int(in[0], n) || !parse_int(in[1], m) ||
      (long long)in.size() < 2 + 2 * m || want.empty())
    return verdict(FAIL, "bad input or answer file");
  std::vector<long long> order;
  std::string bad;
  if (!parse_ints(got, order, bad)) return verdict(PE, "not an integer: " + bad);
  if (got.empty()) return verdict(WA, "empty output");
  if (want[0] == "-1") return order.size() == 1 && order[0] == -1 ? OK : verdict(WA, "expected -1");
  if (order.size() == 1 && order[0] == -1) return verdict(WA, "an order exists");
  if ((long long)order.size() != n)
    return verdict(WA, "expected " + std::to_string(n) + " courses, got " + std::to_string(order.size()));
  std::vector<long long> position(n + 1, -1);
  for (long long i = 0; i < n; ++i) {
    long long c = order[i];
    if (c < 1 || c > n || position[c] >= 0) return verdict(WA, "bad or repeated course " + got[i]);
    position[c] = i;
  }
  for (long long j = 0; j < m; ++j) {
    long long u = 0, v = 0;
    if (!parse_int(in[2 + 2 * j], u) || !parse_int(in[3 + 2 * j], v) || u < 1 || u > n || v < 1 ||
        v > n)
      return verdict(FAIL, "bad input file");
    if (position[u] > position[v])
      return verdict(WA, "course " + std::to_string(u) + " must come before " + std::to_string(v));
  }
  return OK;
}
