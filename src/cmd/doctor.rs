//! `torpor doctor`: what this host can run. Exit status 0 = Linux and probe
//! guests, 10 = probe guests only, 1 = no guests.

pub fn run(json: bool) -> i32 {
    let report = torpor_vmm::doctor::run();
    if json {
        match serde_json::to_string_pretty(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("torpor: error: cannot encode the report: {e}");
                return super::EXIT_FAILURE;
            }
        }
    } else {
        print!("{report}");
    }
    report.exit_code()
}
