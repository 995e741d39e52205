// The dcplan command-line tool: parses the subcommand and reports errors once.
#include <exception>
#include <iostream>

#include "dcplan/schemas/io.h"
#include "subcommands.h"
#include "version.h"

int main(int argc, char** argv) {
  using namespace dcplan::cli;
  CLI::App app{"dcplan: plan the communication of ZeRO-sharded PyTorch training", "dcplan"};
  app.set_version_flag("--version", "dcplan " DCPLAN_VERSION);
  app.require_subcommand(1);
  setupValidate(app);
  setupInspect(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "dcplan: error: " << e.what() << "\n"
              << "Run 'dcplan --help' for usage.\n";
    return kExitBadInput;
  } catch (const dcplan::schemas::InputError& e) {
    std::cerr << "dcplan: error: " << e.what() << "\n";
    return kExitBadInput;
  } catch (const ExitCode& e) {
    return e.code;
  } catch (const std::exception& e) {
    std::cerr << "dcplan: error: " << e.what() << "\n";
    return kExitBadInput;
  }
  return kExitOk;
}
