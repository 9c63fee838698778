//! The `tessera` binary: [`tessera_cli::run`] on this process's arguments.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(tessera_cli::run(std::env::args_os()))
}
