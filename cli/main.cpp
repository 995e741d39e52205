// The dcplan command-line tool: parses the subcommand and reports errors once.
#include <algorithm>
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
  setupRecord(app);
  setupValidate(app);
  setupInspect(app);
  setupPlan(app);
  setupDiff(app);
  setupCheck(app);
  // CLI11 would report an unknown subcommand as a missing one; name it instead.
  const auto subcommands = app.get_subcommands({});
  if (argc > 1 && argv[1][0] != '-' && std::none_of(subcommands.begin(), subcommands.end(), [&](auto* sub) {
        return sub->check_name(argv[1]);
      })) {
    std::string known;
    for (const auto* sub : subcommands) known += (known.empty() ? "" : ", ") + sub->get_name();
    std::cerr << "dcplan: error: unknown subcommand '" << argv[1] << "' (expected one of " << known << ")\n"
              << "Run 'dcplan --help' for usage.\n";
    return kExitBadInput;
  }
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
