// Checker for circle_area: each number must be within 1e-6 absolute or relative error.
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 4) return 3;
  std::ifstream output(argv[2]), answer(argv[3]);
  std::string want_token, got_token;
  int index = 0;
  while (answer >> want_token) {
    ++index;
    if (!(output >> got_token)) {
      std::cerr << "output ended before value " << index << "\n";
      return 1;
    }
    char* end = nullptr;
    double got = std::strtod(got_token.c_str(), &end);
    if (end == got_token.c_str() || *end != '\0' || !std::isfinite(got)) {
      std::cerr << "value " << index << " is not a number\n";
      return 2;
    }
    double want = std::strtod(want_token.c_str(), nullptr);
    double err = std::fabs(got - want);
    if (err > 1e-6 && err > 1e-6 * std::fabs(want)) {
      std::cerr << "value " << index << ": expected " << want_token << ", got " << got_token << "\n";
      return 1;
    }
  }
  if (output >> got_token) {
    std::cerr << "extra output\n";
    return 2;
  }
  return 0;
}
