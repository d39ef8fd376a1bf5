/*
 * main.c: the kvpager program's entry point. Everything else is in the
 * kvpager_cli library (dispatch.c), so tests can run the commands in-process.
 */
#include "cli.h"

int main(int argc, char **argv)
{
    return kvp_cli_main(argc, argv);
}
