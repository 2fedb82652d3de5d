// The line protocol of the llama.cpp helper processes: one command per stdin line, answered with
// one JSON line on stdout, until "quit" or the end of input.
#pragma once

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>

// Answers a command that failed.
inline void answer_error(const std::string & msg) {
    printf("{\"error\":\"%s\"}\n", msg.c_str());
    fflush(stdout);
}

// Calls handle(command, rest_of_line) for each non-empty line until "quit" or end of input.
template <class Handle> void serve_lines(Handle handle) {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd;
        if (!(in >> cmd)) {
            continue;
        }
        if (cmd == "quit") {
            break;
        }
        handle(cmd, in);
    }
}
