// Training from image folders and packs: a short run, the class list kept in the run directory
// and checked, train/val folders that disagree, the loader's own recipe reproducible.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/errors.h"
#include "core/file_io.h"
#include "data/image_codec.h"
#include "data/image_pack.h"
#include "train/config.h"
#include "train/trainer.h"

using namespace replica;
using namespace replica::train;
namespace fs = std::filesystem;

namespace {
// DIR/train and DIR/val, `classes` classes of 8 (train) and 2 (val) JPEGs of a class-coloured square.
std::string image_tree(const std::string& name, const std::vector<std::string>& classes) {
  const std::string d = ::testing::TempDir() + "replica_imgtrain_" + name;
  fs::remove_all(d);
  for (const char* split : {"train", "val"})
    for (size_t c = 0; c < classes.size(); ++c) {
      fs::create_directories(d + "/" + split + "/" + classes[c]);
      for (int i = 0; i < (split == std::string("train") ? 8 : 2); ++i) {
        std::vector<uint8_t> px(20 * 16 * 3);
        for (size_t p = 0; p < px.size(); ++p) px[p] = static_cast<uint8_t>((p % 3 == c % 3 ? 200 : 30) + i);
        std::ofstream(d + "/" + split + "/" + classes[c] + "/" + std::to_string(i) + ".jpg", std::ios::binary)
            << data::encode_jpeg(px.data(), 20, 16, 90);
      }
    }
  return d;
}
std::vector<std::string> sets(const std::string& data, const std::string& run, const std::string& kind = "folder") {
  return {"data.dataset=" + kind, "data.path=" + data, "data.image_size=16", "data.mean=[0.5,0.5,0.5]",
          "data.std=[0.25,0.25,0.25]", "data.hflip=true", "model.width=4", "train.global_batch=8", "train.epochs=1",
          "train.tensorboard=false", "parallel.devices=cpu:2", "train.run_dir=" + run, "data.workers=1"};
}
}  // namespace

TEST(ImageTraining, AFolderAndItsPackTrainAndKeepTheClassList) {
  const std::string d = image_tree("ok", {"cat", "dog", "emu"});
  const std::string run = ::testing::TempDir() + "replica_imgtrain_run";
  fs::remove_all(run);
  Trainer t(parse_config("", "test", sets(d, run)), {.print = false});
  const auto r = t.fit();
  EXPECT_EQ(r.steps, 3);
  EXPECT_EQ(r.test.count, 6);
  EXPECT_EQ(read_file(run + "/classes.txt", "classes"), "cat\ndog\nemu\n");
  // The same run directory with other classes would relabel: refused.
  const std::string other = image_tree("other", {"ant", "bee", "cow"});
  try {
    Trainer bad(parse_config("", "test", sets(other, run)), {.print = false});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("classes.txt"), std::string::npos) << e.what();
  }
  // The packed form of the same folders trains the same way.
  for (const char* split : {"train", "val"}) {
    data::FolderDataset f(d + "/" + split, {});
    data::pack_images(f, d + "/" + split + ".pack", {.max_side = 64, .quality = 95, .threads = 1});
  }
  fs::remove_all(run);
  Trainer p(parse_config("", "test", sets(d, run, "packed")), {.print = false});
  EXPECT_EQ(p.fit().steps, 3);
}

TEST(ImageTraining, TrainAndValMustNameTheSameClasses) {
  const std::string d = image_tree("mismatch", {"cat", "dog"});
  fs::rename(d + "/val/dog", d + "/val/wolf");
  try {
    Trainer t(parse_config("", "test", sets(d, ::testing::TempDir() + "replica_imgtrain_mm")), {.print = false});
    FAIL();
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("only in train: dog"), std::string::npos) << m;
    EXPECT_NE(m.find("only in val: wolf"), std::string::npos) << m;
  }
  EXPECT_THROW(parse_config("", "test", {"data.dataset=folder", "data.pad_crop=4"}), ConfigError);
  try {
    Trainer t(parse_config("", "test", sets("/nonexistent", ::testing::TempDir() + "replica_imgtrain_mm")), {.print = false});
    FAIL();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/train: not a directory"), std::string::npos) << e.what();
  }
}
