//! The host side of the agent protocol: whatever a guest sends back on the
//! vsock stream (frames of any length, JSON or not, replies for other
//! requests, endless output), through the frame decoder and the client's
//! exec and file calls. Every call must end in a value or a typed error,
//! with what it keeps bounded by the caps the host sets.
#![no_main]

use std::io::{Cursor, Read, Write};

use libfuzzer_sys::fuzz_target;
use torpor_agent::frame::read_message;
use torpor_agent::proto::{ExecRequest, Reply};
use torpor_agent::{AgentClient, MAX_FRAME};
use torpor_fuzz::Input;

/// The guest's side of the connection: the input's bytes to read, and a
/// sink for what the host writes.
struct Guest<'a>(Cursor<&'a [u8]>);

impl Read for Guest<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Guest<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const OUTPUT_CAP: u64 = 4096;

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let which = input.u8();
    let stream = input.rest();

    // The bare decoder over the whole stream.
    let mut r = stream;
    while let Ok(Some(_)) = read_message::<Reply>(&mut r, MAX_FRAME) {}

    let Ok(mut client) = AgentClient::connect(Guest(Cursor::new(stream)), "fuzz") else {
        return;
    };
    match which % 4 {
        0 => {
            let req = ExecRequest {
                argv: vec!["true".into()],
                max_output_bytes: Some(OUTPUT_CAP),
                ..ExecRequest::default()
            };
            if let Ok(out) = client.exec_collect(req) {
                let kept = out.stdout.len() + out.stderr.len();
                assert!(kept as u64 <= OUTPUT_CAP, "{kept} bytes of output kept");
            }
        }
        1 => {
            if let Ok(data) = client.read_file_all("/f", OUTPUT_CAP) {
                assert!(data.len() as u64 <= OUTPUT_CAP, "{} bytes read", data.len());
            }
        }
        2 => {
            let _ = client.list_dir("/");
            let _ = client.stat("/", true);
        }
        _ => {
            let _ = client.write_file_all("/f", b"data", None, true);
            let _ = client.info();
            let _ = client.ping();
        }
    }
});
