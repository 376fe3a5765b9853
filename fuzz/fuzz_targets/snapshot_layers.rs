//! A snapshot chain on disk as restore loads it: the top layer's state and
//! lineage record, a parent layer's state, and memory files, through
//! `load_chain` (which follows diff layers to their parents) and
//! `Lineage::read`. What loads must be usable: every diff layer's pages
//! sorted, disjoint and inside guest memory.
//!
//! Input: the memory size in MiB, then three parts each preceded by a
//! 16-bit length: the top state, the parent state (both as
//! `torpor_fuzz::state_input`), then the lineage record (`@TOP@` stands
//! for the top directory's path).
#![no_main]

use std::fs::File;

use libfuzzer_sys::fuzz_target;
use torpor_fuzz::{scratch, state_input, Input};
use torpor_vmm::restore::load_chain;
use torpor_vmm::snapshot::{MEMORY_FILE, STATE_FILE};
use torpor_vmm_api::lineage::{Lineage, LINEAGE_FILE};

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let mib = u64::from(input.u8());
    let top_len = usize::from(input.u16());
    let top_state = state_input(input.bytes(top_len));
    let parent_len = usize::from(input.u16());
    let parent_state = state_input(input.bytes(parent_len));
    let lineage = input.rest();

    let top = scratch().join("top");
    let parent = scratch().join("parent");
    for (dir, state) in [(&top, &top_state), (&parent, &parent_state)] {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).expect("layer directory");
        std::fs::write(dir.join(STATE_FILE), state).expect("state file");
        // Sparse: costs nothing whatever the size.
        File::create(dir.join(MEMORY_FILE))
            .and_then(|f| f.set_len(mib << 20))
            .expect("memory file");
    }
    let text = String::from_utf8_lossy(lineage).replace("@TOP@", &top.to_string_lossy());
    std::fs::write(top.join(LINEAGE_FILE), text.as_bytes()).expect("lineage file");

    let _ = Lineage::read(&top);
    if let Ok(chain) = load_chain(&top) {
        let pages = (chain.state.machine.mem_mib << 20) / 4096;
        for layer in &chain.layers {
            if let Some(runs) = &layer.pages {
                assert!(runs.is_well_formed(), "{:?}", runs.runs());
                assert!(runs.end_page() <= pages, "{:?} past {pages}", runs.runs());
            }
        }
    }
});
