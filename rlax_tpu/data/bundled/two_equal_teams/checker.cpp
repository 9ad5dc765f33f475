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
  long long n = 0;
  if (in.empty() || !parse_int(in[0], n) || n < 1 || want.empty())
    return verdict(FAIL, "bad input or answer file");
  if (got.empty()) return verdict(WA, "empty output");
  std::string word = got[0];
  for (auto& c : word) c = std::toupper(static_cast<unsigned char>(c));
  if (word != "YES" && word != "NO") return verdict(PE, "expected YES or NO, got " + clip(got[0]));
  if (want[0] == "NO") return word == "NO" && got.size() == 1 ? OK : verdict(WA, "expected NO");
  std::vector<long long> numbers;
  std::string bad;
  if (!parse_ints(std::vector<std::string>(got.begin() + 1, got.end()), numbers, bad))
    return verdict(PE, "not an integer: " + bad);
  if (word == "NO") return verdict(WA, "a split exists");
  if (numbers.empty()) return verdict(WA, "missing k");
  long long k = numbers[0];
  if (k < 1 || k > n) return verdict(WA, "k out of range");
  if ((long long)got.size() != 2 + k)
    return verdict(WA, "expected " + std::to_string(k) + " strengths after k");
  std::vector<bool> used(n + 1);
  long long sum = 0;
  for (long long i = 0; i < k; ++i) {
    long long x = numbers[1 + i];
    if (x < 1 || x > n || used[x]) return verdict(WA, "bad or repeated strength " + got[2 + i]);
    used[x] = true;
    sum += x;
  }
  if (2 * sum != n * (n + 1) / 2) return verdict(WA, "the teams' strengths differ");
  return OK;
}
