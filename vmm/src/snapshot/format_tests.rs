//! Tests of the state file format: round trip and every bad input.

use super::*;
use crate::snapshot::TestDir;
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Sample {
    id: String,
    regs: Vec<u64>,
    flag: bool,
    nested: Option<(u32, Vec<u8>)>,
}

fn sample() -> Sample {
    Sample {
        id: "sandbox-42".into(),
        regs: (0..64).map(|i| i * 0x1111_1111).collect(),
        flag: true,
        nested: Some((7, vec![1, 2, 3, 4, 5])),
    }
}

/// A valid state file in `dir`; returns its path and bytes.
fn written(dir: &TestDir) -> (PathBuf, Vec<u8>) {
    let path = dir.path("state");
    write_state(&path, &sample()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    (path, bytes)
}

/// Rewrites `bytes[..28]`'s CRC so that header edits pass the header check.
fn fix_header_crc(bytes: &mut [u8]) {
    let crc = crc32fast::hash(&bytes[..28]);
    bytes[28..32].copy_from_slice(&crc.to_le_bytes());
}

/// Both readers (file and bytes) must give the same verdict.
fn read_both(path: &Path, bytes: &[u8]) -> (SnapshotError, SnapshotError) {
    std::fs::write(path, bytes).unwrap();
    let from_file = read_state::<Sample>(path).unwrap_err();
    let from_bytes = read_state_bytes::<Sample>(path, bytes).unwrap_err();
    assert_eq!(
        std::mem::discriminant(&from_file),
        std::mem::discriminant(&from_bytes),
        "{from_file} vs {from_bytes}"
    );
    let msg = from_file.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    (from_file, from_bytes)
}

#[test]
fn round_trip() {
    let dir = TestDir::new("state-roundtrip");
    let (path, bytes) = written(&dir);
    assert_eq!(read_state::<Sample>(&path).unwrap(), sample());
    assert_eq!(read_state_bytes::<Sample>(&path, &bytes).unwrap(), sample());
    let (_, header) = read_state_with_header::<Sample>(&path).unwrap();
    assert_eq!(
        (header.major, header.minor, header.flags),
        (FORMAT_MAJOR, 0, 0)
    );
    assert_eq!(header.payload_len as usize, bytes.len() - HEADER_LEN);
    assert_eq!(&bytes[..8], b"TORPSNAP");
    assert_eq!(encode(&sample()).unwrap(), bytes);
    // No temporary file is left behind.
    assert_eq!(dir.entries(), vec!["state".to_string()]);
}

#[test]
fn write_returns_size_and_replaces_existing_file() {
    let dir = TestDir::new("state-replace");
    let path = dir.path("state");
    std::fs::write(&path, vec![0xaa; 100_000]).unwrap();
    let n = write_state(&path, &sample()).unwrap();
    assert_eq!(n, std::fs::metadata(&path).unwrap().len());
    assert_eq!(read_state::<Sample>(&path).unwrap(), sample());
    assert_eq!(dir.entries(), vec!["state".to_string()]);
}

#[test]
fn header_layout_is_little_endian_at_fixed_offsets() {
    let bytes = encode(&42u32).unwrap();
    assert_eq!(bytes.len(), HEADER_LEN + 4);
    assert_eq!(&bytes[8..10], &FORMAT_MAJOR.to_le_bytes());
    assert_eq!(&bytes[10..12], &0u16.to_le_bytes());
    assert_eq!(&bytes[12..16], &[0; 4]);
    assert_eq!(&bytes[16..24], &4u64.to_le_bytes());
    let payload_crc = crc32fast::hash(&42u32.to_le_bytes());
    assert_eq!(&bytes[24..28], &payload_crc.to_le_bytes());
    assert_eq!(&bytes[28..32], &crc32fast::hash(&bytes[..28]).to_le_bytes());
}

#[test]
fn truncated_at_any_point() {
    let dir = TestDir::new("state-truncated");
    let (path, bytes) = written(&dir);
    let total = bytes.len() as u64;
    for cut in [0, 1, 8, 27, 31, 32, 33, bytes.len() / 2, bytes.len() - 1] {
        let (err, _) = read_both(&path, &bytes[..cut]);
        let SnapshotError::Truncated {
            expected, actual, ..
        } = err
        else {
            panic!("cut at {cut}: {err}");
        };
        assert_eq!(actual, cut as u64, "cut at {cut}");
        let want = if cut < HEADER_LEN { 32 } else { total };
        assert_eq!(expected, want, "cut at {cut}");
    }
}

#[test]
fn missing_file_is_io_error() {
    let dir = TestDir::new("state-missing");
    let err = read_state::<Sample>(&dir.path("state")).unwrap_err();
    assert!(matches!(err, SnapshotError::Io { .. }), "{err}");
    assert!(err.to_string().contains("state"), "{err}");
}

#[test]
fn bad_magic_is_not_a_snapshot() {
    let dir = TestDir::new("state-magic");
    let (path, mut bytes) = written(&dir);
    bytes[0] = b'X';
    let (err, _) = read_both(&path, &bytes);
    assert!(matches!(err, SnapshotError::NotASnapshot { .. }), "{err}");
    // A short file that is plainly something else is not "truncated".
    let (err, _) = read_both(&path, b"#!/bin/sh\n");
    assert!(matches!(err, SnapshotError::NotASnapshot { .. }), "{err}");
    assert!(err.to_string().contains("not a torpor snapshot"), "{err}");
}

#[test]
fn flipped_header_byte_is_corrupt() {
    let dir = TestDir::new("state-header");
    let (path, bytes) = written(&dir);
    for i in 8..HEADER_LEN {
        let mut bad = bytes.clone();
        bad[i] ^= 0x10;
        let (err, _) = read_both(&path, &bad);
        assert!(
            matches!(err, SnapshotError::Corrupt { .. }),
            "byte {i}: {err}"
        );
    }
}

#[test]
fn flipped_payload_byte_is_crc_mismatch() {
    let dir = TestDir::new("state-payload");
    let (path, bytes) = written(&dir);
    for i in [HEADER_LEN, HEADER_LEN + 5, bytes.len() - 1] {
        let mut bad = bytes.clone();
        bad[i] ^= 0x01;
        let (err, _) = read_both(&path, &bad);
        let SnapshotError::CrcMismatch {
            stored, computed, ..
        } = err
        else {
            panic!("byte {i}: {err}");
        };
        assert_ne!(stored, computed);
    }
}

#[test]
fn other_majors_are_refused_with_both_versions_named() {
    for major in [FORMAT_MAJOR + 1, FORMAT_MAJOR - 1] {
        let dir = TestDir::new("state-major");
        let (path, mut bytes) = written(&dir);
        bytes[8..10].copy_from_slice(&major.to_le_bytes());
        fix_header_crc(&mut bytes);
        let (err, _) = read_both(&path, &bytes);
        assert!(
            matches!(
                err,
                SnapshotError::UnsupportedVersion {
                    found_major,
                    found_minor: 0,
                    supported_major,
                    ..
                } if found_major == major && supported_major == FORMAT_MAJOR
            ),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&format!("format version {major}.0")), "{msg}");
        assert!(msg.contains(&format!("reads {FORMAT_MAJOR}.x")), "{msg}");
    }
}

#[test]
fn newer_minor_is_accepted_and_ignores_appended_fields() {
    #[derive(Serialize)]
    struct SampleV1_1 {
        id: String,
        regs: Vec<u64>,
        flag: bool,
        nested: Option<(u32, Vec<u8>)>,
        added_in_1_1: Vec<u32>,
    }
    let s = sample();
    let newer = SampleV1_1 {
        id: s.id,
        regs: s.regs,
        flag: s.flag,
        nested: s.nested,
        added_in_1_1: vec![9; 10],
    };
    let mut bytes = encode(&newer).unwrap();
    bytes[10..12].copy_from_slice(&7u16.to_le_bytes());
    bytes[12..16].copy_from_slice(&1u32.to_le_bytes()); // unknown flag: ignored
    fix_header_crc(&mut bytes);
    let dir = TestDir::new("state-minor");
    let path = dir.path("state");
    std::fs::write(&path, &bytes).unwrap();
    let (state, header) = read_state_with_header::<Sample>(&path).unwrap();
    assert_eq!(state, sample());
    assert_eq!(
        (header.major, header.minor, header.flags),
        (FORMAT_MAJOR, 7, 1)
    );
}

#[test]
fn huge_payload_len_is_too_large_without_allocating() {
    let dir = TestDir::new("state-huge");
    let (path, mut bytes) = written(&dir);
    for len in [MAX_STATE_BYTES + 1, u64::MAX] {
        bytes[16..24].copy_from_slice(&len.to_le_bytes());
        fix_header_crc(&mut bytes);
        // Were u64::MAX trusted, Vec::with_capacity would abort the test.
        let (err, _) = read_both(&path, &bytes);
        assert!(
            matches!(err, SnapshotError::TooLarge { len: l, .. } if l == len),
            "{err}"
        );
    }
}

#[test]
fn write_refuses_state_over_the_limit() {
    let dir = TestDir::new("state-write-huge");
    let path = dir.path("state");
    let big = vec![0u8; MAX_STATE_BYTES as usize + 1];
    let err = write_state(&path, &big).unwrap_err();
    assert!(matches!(err, SnapshotError::TooLarge { .. }), "{err}");
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
}

#[test]
fn trailing_bytes_after_payload_are_refused() {
    let dir = TestDir::new("state-trailing");
    let (path, mut bytes) = written(&dir);
    bytes.extend_from_slice(b"junk");
    let (err, _) = read_both(&path, &bytes);
    let SnapshotError::TrailingData {
        expected, actual, ..
    } = err
    else {
        panic!("{err}");
    };
    assert_eq!(actual, expected + 4);
}

#[test]
fn valid_frame_with_undecodable_payload_is_decode_error() {
    let dir = TestDir::new("state-decode");
    let path = dir.path("state");
    // A u8 payload: a valid frame, but far too short for a Sample.
    write_state(&path, &3u8).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let (err, _) = read_both(&path, &bytes);
    assert!(matches!(err, SnapshotError::Decode { .. }), "{err}");
}
