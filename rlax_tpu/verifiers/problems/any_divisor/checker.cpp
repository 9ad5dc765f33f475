// Checker for any_divisor (testlib protocol, without testlib): checker input output answer.
// Any proper divisor is accepted; -1 only when the jury found none (n is prime).
#include <cctype>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

static int verdict(int code, const std::string& message) {
  std::cerr << message << "\n";
  return code;
}

static bool parse_int(const std::string& s, long long& v) {
  if (s.empty() || s.size() > 19) return false;
  size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  for (size_t j = i; j < s.size(); ++j)
    if (!std::isdigit((unsigned char)s[j])) return false;
  v = std::stoll(s);
  return true;
}

int main(int argc, char** argv) {
  if (argc < 4) return verdict(3, "usage: checker input output answer");
  std::ifstream input(argv[1]), output(argv[2]), answer(argv[3]);
  long long n = 0, jury = 0, got = 0;
  if (!(input >> n) || !(answer >> jury)) return verdict(3, "bad input or answer file");
  std::string token, extra;
  if (!(output >> token)) return verdict(2, "empty output");
  if (!parse_int(token, got)) return verdict(2, "not an integer: " + token.substr(0, 20));
  if (output >> extra) return verdict(2, "extra output after the answer");
  if (jury == -1) return got == -1 ? 0 : verdict(1, "n is prime, expected -1");
  if (got == -1) return verdict(1, "a divisor exists");
  if (got <= 1 || got >= n || n % got != 0)
    return verdict(1, std::to_string(got) + " is not a proper divisor of " + std::to_string(n));
  return 0;
}
